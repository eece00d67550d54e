"""Tool calls an upstream server parsed and streamed, carried in the text (sans-I/O).

An OpenAI-compatible upstream streams its calls as ``delta.tool_calls``
parts. The relay (:mod:`wsserver.backends.openai_relay`) writes each part
into the request's text as it arrives — :data:`RELAY_MARKER` and a JSON
object (:func:`relay_part_text`) — so that it takes every engine's path
through the core: the tool call parser's ``relay`` syntax
(:class:`~wsserver.tool_calls.ToolCallParser`) hands each part to
:class:`RelayedCalls`, which releases it at once as the core's
:class:`~wsserver.call_parts.CallPart` — the upstream's id, name and
argument fragments as they came, paced, numbered and replayed like text —
and checks each call's joined arguments when the output ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import orjson

from .call_parts import CallPart, call_parts, unknown_tool

__all__ = ["RELAY_MARKER", "RelayedCalls", "relay_part_text"]

#: Opens a call part a relay writes into its text (a private-use character,
#: which no upstream's content is expected to hold).
RELAY_MARKER: Final = "\ue000"


def relay_part_text(
    index: int, arguments: str, call_id: str | None = None, name: str | None = None
) -> str:
    """A part of a call an upstream streamed — its ``index``, the
    ``arguments`` text it adds, and for a call's first part its ``id`` (if
    the upstream gave one) and ``name`` — as the text the ``relay`` syntax
    reads back."""
    part: dict[str, Any] = {"index": index, "arguments": arguments}
    if name is not None:
        part["name"] = name
        if call_id:
            part["id"] = call_id
    return RELAY_MARKER + orjson.dumps(part).decode()


class RelayedCalls:
    """The calls of one output, part by part."""

    __slots__ = ("_calls", "_max_calls", "_names", "_new_id")

    def __init__(
        self,
        *,
        names: frozenset[str] | None,
        max_calls: int | None,
        new_id: Callable[[], str],
    ) -> None:
        self._names = names
        self._max_calls = max_calls
        self._new_id = new_id
        #: The upstream's index → [our index (-1: not read), name, arguments so far].
        self._calls: dict[int, list[Any]] = {}

    @property
    def made(self) -> int:
        """How many calls were released."""
        return sum(1 for call in self._calls.values() if call[0] >= 0)

    def part(self, body: str) -> tuple[list[CallPart], str | None]:
        """One part (the JSON object the relay wrote): the parts to release,
        or why the call is refused."""
        part = orjson.loads(body)  # the relay wrote it: valid JSON
        upstream: int = part["index"]
        arguments: str = part["arguments"]
        call = self._calls.get(upstream)
        if call is not None:
            if call[0] < 0 or not arguments:
                return [], None
            call[2] += arguments
            return _more(call[0], arguments), None
        name = part.get("name")
        if self._max_calls is not None and self.made >= self._max_calls:
            self._calls[upstream] = [-1, name, ""]  # one call asked for: not read
            return [], None
        if not name:
            return [], f"the upstream's tool call names no function: {body[:120]}"
        refused = unknown_tool(name, self._names)
        if refused is not None:
            return [], refused
        index = self.made
        self._calls[upstream] = [index, name, arguments]
        return call_parts(index, arguments, part.get("id") or self._new_id(), name), None

    def end(self, *, cut: bool) -> tuple[list[CallPart], str | None]:
        """The output ended: each call's joined arguments must be a JSON object
        — but the last one's if the output was ``cut`` off (it is as far as
        it got). A call that came with no arguments at all gets ``{}``."""
        made = [call for call in self._calls.values() if call[0] >= 0]
        parts: list[CallPart] = []
        for number, (index, name, arguments) in enumerate(made):
            last_cut = cut and number == len(made) - 1
            if not arguments:
                if not last_cut:
                    parts.append(CallPart(index, "{}"))
                continue
            if last_cut:
                break
            try:
                value = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                return parts, f"the arguments of the upstream's call to {name!r} are not valid JSON"
            if not isinstance(value, dict):
                return parts, (
                    f"the arguments of the upstream's call to {name!r} are not a JSON object"
                )
        return parts, None


def _more(index: int, arguments: str) -> list[CallPart]:
    """Later parts of call ``index``: its ``arguments`` in fragments."""
    return [CallPart(index, piece.arguments) for piece in call_parts(index, arguments)]

"""Tool calls an engine parsed itself, carried in its text: the ``relay`` syntax (sans-I/O).

An OpenAI-compatible upstream parses its model's calls and streams them as
``delta.tool_calls`` parts. The relay (:mod:`wsserver.backends.openai_relay`)
writes each part into the request's text as it arrives — :data:`RELAY_MARKER`
and a JSON object (:func:`relay_part_text`). :class:`RelayedCalls` is the
``relay`` syntax's parser (:mod:`wsserver.tool_calls`): the engine's text is
content exactly as it came (no model syntax is looked for in it) but for
those parts, and each part is released at once as the core's
:class:`~wsserver.call_parts.CallPart` — the upstream's id, name and
argument fragments as they came, renumbered in the order the calls came, so
that they take every engine's path (paced, numbered, replayed) — and each
call's joined arguments are checked when the output ends.

Its state is explicit: the text held back (a part not whole yet), the
upstream's calls by their index, each either released (with its index here,
name and arguments so far) or not read (past the one call asked for); and
the ledger's (the calls made, the first refusal, after which nothing more is
read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from .call_parts import CallLedger, CallPart, ToolSplit, call_parts, new_call_id, unknown_tool
from .json_text import json_extent

__all__ = ["RELAY_MARKER", "RelayedCalls", "relay_part_text"]

#: Opens a call part a relay writes into its text (a private-use character,
#: which no upstream's content is expected to hold).
RELAY_MARKER: Final = "\ue000"

_NOTHING: Final = ToolSplit()


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


@dataclass(slots=True)
class _Call:
    """One of the upstream's calls: its index here (-1: not read), its name,
    its arguments so far."""

    index: int
    name: str
    arguments: str


class RelayedCalls:
    """The calls of one output, part by part, and its text as content."""

    __slots__ = ("_calls", "_done", "_held", "_ledger")

    def __init__(
        self,
        *,
        names: frozenset[str] | None = None,
        parallel: bool = True,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self._ledger = CallLedger(names=names, parallel=parallel, new_id=new_id or new_call_id)
        #: The upstream's calls, by the upstream's index.
        self._calls: dict[int, _Call] = {}
        #: The output ended, or a call was refused: nothing more is read.
        self._done = False
        #: A part not whole yet (from its marker on).
        self._held = ""

    @property
    def calls_made(self) -> int:
        """How many calls were released."""
        return self._ledger.made

    def feed(self, text: str) -> ToolSplit:
        """The engine's text: content, as it came, but for the parts written
        into it — each released as :meth:`part` releases it."""
        if self._done or not text:
            return _NOTHING
        held = self._held + text
        self._held = ""
        content: list[str] = []
        calls: list[CallPart] = []
        while held and not self._done:
            at = held.find(RELAY_MARKER)
            if at < 0:
                content.append(held)
                break
            content.append(held[:at])
            body = held[at + len(RELAY_MARKER) :]
            end = json_extent(body)
            if end < 0:
                self._held = held[at:]  # the rest of the part is still to come
                break
            held = body[end:]
            found = self.part(_read(body[:end]))
            calls.extend(found.calls)
            if found.error is not None:
                return ToolSplit("".join(content), tuple(calls), found.error)
        if not content and not calls:
            return _NOTHING
        return ToolSplit("".join(content), tuple(calls))

    def part(self, part: CallPart) -> ToolSplit:
        """A part of one of the upstream's calls (its ``index`` the
        upstream's; its first part with ``name`` and maybe ``id``): the parts
        to release, or why the call is refused."""
        if self._done:
            return _NOTHING
        ledger = self._ledger
        call = self._calls.get(part.index)
        if call is not None:
            if call.index < 0 or not part.arguments:
                return _NOTHING
            call.arguments += part.arguments
            return ToolSplit(calls=_more(call.index, part.arguments))
        name = part.name
        if ledger.full:
            self._calls[part.index] = _Call(-1, name or "", "")  # one call asked for: not read
            return _NOTHING
        if not name:
            return self._refuse(f"the upstream's tool call names no function: {_shown(part)}")
        refused = unknown_tool(name, ledger.names)
        if refused is not None:
            return self._refuse(refused)
        index = ledger.made
        ledger.made += 1
        self._calls[part.index] = _Call(index, name, part.arguments)
        first = call_parts(index, part.arguments, part.id or ledger.new_id(), name)
        return ToolSplit(calls=tuple(first))

    def flush(self, *, cut: bool = False) -> ToolSplit:
        """The output ended: each call's joined arguments must be a JSON object
        — but the last one's if the output was ``cut`` off (it is as far as
        it got). A call that came with no arguments at all gets ``{}``."""
        if self._done:
            return _NOTHING
        self._done = True
        if self._held:
            return ToolSplit(error="the model's tool call was cut off before its end")
        made = [call for call in self._calls.values() if call.index >= 0]
        parts: list[CallPart] = []
        for number, call in enumerate(made):
            last_cut = cut and number == len(made) - 1
            if not call.arguments:
                if not last_cut:
                    parts.append(CallPart(call.index, "{}"))
                continue
            if last_cut:
                break
            try:
                value = orjson.loads(call.arguments)
            except orjson.JSONDecodeError:
                error = f"the arguments of the upstream's call to {call.name!r} are not valid JSON"
                return ToolSplit(calls=tuple(parts), error=error)
            if not isinstance(value, dict):
                error = (
                    f"the arguments of the upstream's call to {call.name!r} are not a JSON object"
                )
                return ToolSplit(calls=tuple(parts), error=error)
        return ToolSplit(calls=tuple(parts)) if parts else _NOTHING

    def _refuse(self, message: str) -> ToolSplit:
        self._done = True
        return ToolSplit(error=message)


def _more(index: int, arguments: str) -> tuple[CallPart, ...]:
    """Later parts of call ``index``: its ``arguments`` in fragments."""
    return tuple(CallPart(index, piece.arguments) for piece in call_parts(index, arguments))


def _read(body: str) -> CallPart:
    """A part as the relay wrote it (:func:`relay_part_text`)."""
    part = orjson.loads(body)  # the relay wrote it: valid JSON
    return CallPart(part["index"], part["arguments"], part.get("id"), part.get("name"))


def _shown(part: CallPart) -> str:
    """A part as the old text carried it, for an error message: at most 120 characters."""
    shown = {"index": part.index, "arguments": part.arguments}
    if part.name is not None:
        shown["name"] = part.name
        if part.id:
            shown["id"] = part.id
    return orjson.dumps(shown).decode()[:120]

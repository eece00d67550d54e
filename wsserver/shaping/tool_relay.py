"""Tool calls an engine parsed itself, as parts: the ``relay`` syntax (sans-I/O).

An OpenAI-compatible upstream parses its model's calls and streams them as
``delta.tool_calls`` parts; the relay (:mod:`wsserver.backends.openai_relay`)
hands each one to the request's sink as it arrives
(:meth:`~wsserver.backends.base.Sink.offer_call`), beside the text, never
in it. :class:`RelayedCalls` is the ``relay`` syntax's parser
(:mod:`wsserver.shaping.tool_calls`): the engine's text is content exactly as it
came (no model syntax is looked for in it), and each part is released at
once as the core's :class:`~wsserver.core.call_parts.CallPart` — the upstream's
id, name and argument fragments as they came, renumbered in the order the
calls came, so that they take every engine's path (paced, numbered,
replayed) — and each call's joined arguments are checked when the output
ends.

Its state is explicit: the upstream's calls by their index, each either
released (with its index here, name and arguments so far) or not read
(past the one call asked for); and the ledger's (the calls made, the first
refusal, after which nothing more is read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import orjson

from ..core.call_parts import CallLedger, CallPart, ToolSplit, call_parts, new_call_id, unknown_tool

__all__ = ["RelayedCalls"]

_NOTHING: Final = ToolSplit()


@dataclass(slots=True)
class _Call:
    """One of the upstream's calls: its index here (-1: not read), its name,
    its arguments so far."""

    index: int
    name: str
    arguments: str


class RelayedCalls:
    """The calls of one output, part by part, and its text as content."""

    __slots__ = ("_calls", "_done", "_ledger")

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

    @property
    def calls_made(self) -> int:
        """How many calls were released."""
        return self._ledger.made

    def feed(self, text: str) -> ToolSplit:
        """The engine's text: content, as it came."""
        if self._done or not text:
            return _NOTHING
        return ToolSplit(text)

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


def _shown(part: CallPart) -> str:
    """A part as the old text carried it, for an error message: at most 120 characters."""
    shown = {"index": part.index, "arguments": part.arguments}
    if part.name is not None:
        shown["name"] = part.name
        if part.id:
            shown["id"] = part.id
    return orjson.dumps(shown).decode()[:120]

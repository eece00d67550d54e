"""A model's tool calls found while their JSON is written (sans-I/O).

:class:`~wsserver.shaping.text_calls.TextCalls` hands the JSON text of a call
— Hermes/Qwen's object inside ``<tool_call>``, Mistral's array after
``[TOOL_CALLS]``, a Llama 3.x call or the generic ``{"tool_call": …}`` /
``{"tool_calls": […]}`` — to a :class:`CallStream` as it grows. The stream
follows its structure (:class:`~wsserver.shaping.json_text.JsonScanner`) and says,
for each call object in it, as soon as it is known:

* :class:`Named` — the call's ``name`` (and its ``id``, if the model wrote
  one before): its first part can go out;
* :class:`Arguments` — the raw text of its ``arguments`` (or
  ``parameters``) object as the model writes it, so that the fragments join
  to exactly that JSON text; arguments written before the name are held
  until the name is read, then given at once;
* :class:`Ended` — the call object's whole text, for the parser to check as
  it checked a whole call before (valid JSON, a known function, arguments
  that are an object).

Arguments that are not an object (a JSON string holding the object, as some
templates write them, or a wrong type) are not streamed: the parser reads
them from the ended call, as before. An ``id`` the model writes after the
call's name is not used (the call's first part is gone by then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import orjson

from .json_text import JsonEvent, JsonExtent, JsonScanner

__all__ = ["Arguments", "CallKind", "CallStream", "Ended", "Found", "Named"]

#: What holds the calls: one call object (``hermes``), Mistral's array of
#: them (or one), or JSON that may be a call or the generic envelope.
CallKind = Literal["hermes", "mistral", "json"]

_ARGUMENT_KEYS: Final = ("arguments", "parameters")


@dataclass(frozen=True, slots=True)
class Named:
    """A call's name was read (``call_id``: the model's, if it wrote one first)."""

    name: str
    call_id: str | None


@dataclass(frozen=True, slots=True)
class Arguments:
    """More of the named call's arguments' JSON text."""

    text: str


@dataclass(frozen=True, slots=True)
class Ended:
    """A call object ended: its ``text``; ``streamed``: its arguments went
    out as :class:`Arguments` (else they are read from the text)."""

    text: str
    streamed: bool


Found = Named | Arguments | Ended


class _Call:
    """A value in a call's place, while it is read."""

    __slots__ = ("args_end", "args_object", "args_start", "call_id", "depth", "named", "released")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.named = False
        self.call_id: str | None = None
        #: Where its arguments' value begins and ends (-1: not yet).
        self.args_start = self.args_end = -1
        self.args_object = False
        #: How far its arguments' text was given.
        self.released = -1


class CallStream:
    """The calls in one JSON text, as the text grows (:meth:`feed`)."""

    __slots__ = ("_calls", "_containers", "_extent", "_keys", "_kind", "_scanner", "_text", "found")

    def __init__(self, kind: CallKind) -> None:
        self._kind = kind
        self._text = ""
        self._extent = JsonExtent()
        self._scanner = JsonScanner()
        #: The open call values, outermost first (two at most: the generic
        #: format's outer object, which may be a call, and a call inside it).
        self._calls: list[_Call] = []
        #: Per depth, the open container ("{" or "[") and the last key read.
        self._containers: dict[int, str] = {}
        self._keys: dict[int, str] = {}
        #: How many calls were named, or ended without a name (to be refused).
        self.found = 0

    @property
    def end(self) -> int:
        """The length of the JSON text once it ended (brackets balanced), else -1."""
        return self._extent.end

    @property
    def named(self) -> bool:
        """Whether a call's name was read."""
        return self.found > 0

    def feed(self, text: str) -> list[Found]:
        """The JSON text so far (what was fed before and more): what it tells."""
        new = text[len(self._text) :]
        self._text = text
        end = self._extent.feed(new)
        scanned = self._scanner.position
        limit = end if end >= 0 else len(text)
        found: list[Found] = []
        for event in self._scanner.feed(text[scanned:limit]):
            self._event(event, found)
        call = self._calls[-1] if self._calls else None
        if call is not None and not self._scanner.broken:
            self._release(call, self._scanner.position, found)
        return found

    def cut_arguments(self) -> str:
        """The text was cut off: the rest of the open call's arguments that
        were not given (a JSON string's text so far), if it was named."""
        call = self._calls[-1] if self._calls else None
        if call is None or not call.named or call.args_start < 0 or call.args_object:
            return ""
        if call.args_end >= 0:  # a whole string: the JSON text it holds
            return _string(self._text[call.args_start : call.args_end]) or ""
        return self._text[call.args_start :]

    # ------------------------------------------------------------ events

    def _event(self, event: JsonEvent, found: list[Found]) -> None:
        depth = event.depth
        if event.kind == "key":
            self._keys[depth] = _string(self._text[event.start : event.end]) or ""
            return
        parent = self._containers.get(depth - 1) if depth else None
        key = self._keys.get(depth) if parent == "{" else None
        member = self._calls[-1] if self._calls and self._calls[-1].depth == depth - 1 else None
        if event.kind == "open":
            char = self._text[event.start]
            if char in "{[":
                self._containers[depth] = char
            if member is not None and key in _ARGUMENT_KEYS and member.args_start < 0:
                member.args_start = member.released = event.start
                member.args_object = char == "{"
            if self._is_call(depth, key, char):
                self._calls.append(_Call(depth))
            return
        # A value ended.
        call = self._calls[-1] if self._calls else None
        if call is not None and call.depth == depth:
            self._calls.pop()
            # (The generic format's outer object without a name is not a
            # call: the parser reads it whole.)
            if call.named or depth > 0 or self._kind != "json":
                if not call.named:
                    self.found += 1
                self._release(call, event.end, found)
                text = self._text[event.start : event.end]
                found.append(Ended(text, call.named and call.args_object))
            return
        if member is None:
            return
        value = self._text[event.start : event.end]
        if key in _ARGUMENT_KEYS and event.start == member.args_start:
            member.args_end = event.end
            self._release(member, event.end, found)
        elif key == "id" and not member.named:
            member.call_id = _string(value)
        elif key == "name" and not member.named and (name := _string(value)) is not None:
            if member.depth == 0 and self._kind == "json" and self.found:
                return  # a call inside the envelope came first: this is no call
            member.named = True
            self.found += 1
            found.append(Named(name, member.call_id))
            if member.args_end >= 0:
                self._release(member, member.args_end, found)

    def _is_call(self, depth: int, key: str | None, char: str) -> bool:
        """Whether a value opening at ``depth`` (a member ``key``'s, or an
        element) is in a call's place."""
        if self._kind == "hermes":
            return depth == 0
        if self._kind == "mistral":
            return (depth == 0 and char != "[") or (depth == 1 and self._containers[0] == "[")
        # The generic format: the outer object may be a call (it is one once
        # it has a name); a call inside it is ``tool_call``'s object or an
        # element of ``tool_calls``'s array — unless the outer one is named.
        if depth == 0:
            return char == "{"
        outer = self._calls[0] if self._calls and self._calls[0].depth == 0 else None
        if outer is None or outer.named:
            return False
        if depth == 1:
            return key == "tool_call" and char == "{"
        return depth == 2 and self._containers[1] == "[" and self._keys.get(1) == "tool_calls"

    def _release(self, call: _Call, until: int, found: list[Found]) -> None:
        """Give ``call``'s arguments' text up to ``until`` (if it is named
        and its arguments are an object)."""
        if not call.named or not call.args_object or call.args_start < 0:
            return
        if call.args_end >= 0:
            until = min(until, call.args_end)
        if until > call.released:
            found.append(Arguments(self._text[call.released : until]))
            call.released = until


def _string(text: str) -> str | None:
    """A JSON string's value (None if ``text`` is not one)."""
    if not text.startswith('"'):
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None

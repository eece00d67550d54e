"""Tool calls a model writes into its text, found as the text comes (sans-I/O).

Theory of operation
-------------------
:class:`TextCalls` reads a model's final text (after the reasoning
splitter) piece by piece and turns it into content and call parts. What a
syntax looks like is its subclass's (:mod:`wsserver.shaping.tool_calls`): the
markers that open a call (:attr:`TextCalls.OPENERS`, each with the kind of
JSON that follows it: a ``hermes`` object, a ``mistral`` array, or ``json``
— a call object or llama.cpp's generic envelope) and whether a bare JSON
call may open the output (:attr:`TextCalls.JSON_AT_START`). The parser is in
one :attr:`TextCalls.state` at a time:

* ``start`` — the output's start, or just after a JSON call (syntaxes with
  a JSON start only): whitespace is held, ``{`` opens a JSON call, ``;``
  separates calls (Llama 3.x), anything else is ``text``;
* ``text`` — content, released as it comes, holding back exactly what may
  still become a marker (``"<tool_c"`` at its end), so a marker split
  anywhere is still found and released text is never taken back; a marker
  opens a ``call`` (or, for ``<|python_tag|>``, a ``start``); whitespace
  between a model's calls is dropped;
* ``call`` — inside a call's JSON: :class:`~wsserver.shaping.call_stream.CallStream`
  follows it, and its parts go out as it is written — the first (id and
  ``name``, one of the request's tools) once the name is read, then the raw
  text of its ``arguments`` object in fragments that join to exactly the
  model's JSON text. When the JSON ends it is checked whole: a call that is
  not valid JSON, names no known tool, or whose arguments are not a JSON
  object is refused (:attr:`~wsserver.core.call_parts.ToolSplit.error`, after the
  parts already released), never passed off as a call. Arguments written as
  a JSON string (holding the object) go out at the call's end, whole. JSON
  that holds no call is content (the generic format's answer, or text);
* ``answer`` — inside the string of the generic ``{"response": "…"}``: its
  text is content as it comes, decoded piece by piece
  (:class:`~wsserver.shaping.json_text.StringDecoder`), not once its JSON closes;
* ``done`` — a call was refused, or the one call asked for was made:
  nothing more is read.

At the end (:meth:`TextCalls.flush`) what was held back is judged: held
text is content, a call without (all of) Hermes' closing tag is whole, a
call the output was cut off in (``max_tokens``: ``cut``) is released as far
as it got — its name and its arguments' text so far, as OpenAI reports such
a call — and any other unfinished call is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar, Final, Literal

import orjson

from ..core.call_parts import (
    CallLedger,
    CallPart,
    ToolSplit,
    add_arguments,
    excerpt,
    new_call_id,
)
from .call_stream import Arguments, CallKind, CallStream, Ended, Found, Named
from .json_text import StringDecoder, json_extent

__all__ = ["HERMES_END", "State", "TextCalls"]

State = Literal["start", "text", "call", "answer", "done"]

#: What closes a Hermes call block (optional at the output's end).
HERMES_END: Final = "</tool_call>"
_WS: Final = " \t\r\n"
#: What opens llama.cpp's generic answer, ``{"response": "…"}``, up to its string.
_RESPONSE: Final = re.compile(r'\{\s*"response"\s*:\s*"')
#: Nothing came of a piece (shared: most pieces of a plain answer).
_NOTHING: Final = ToolSplit()


class TextCalls:
    """Splits a stream of text into content and the calls written in it."""

    #: The markers that open a call, each with the kind of JSON after it
    #: (``json`` after a marker: the call opens at the next ``{``).
    OPENERS: ClassVar[dict[str, CallKind]] = {}
    #: A bare JSON call may open the output (after whitespace).
    JSON_AT_START: ClassVar[bool] = False
    #: A fresh id, in the shape the model's template takes back.
    NEW_ID: ClassVar[Callable[[], str]] = staticmethod(new_call_id)

    __slots__ = ("_buffer", "_decoder", "_kind", "_ledger", "_live", "_longest", "_stream", "state")

    def __init__(
        self,
        *,
        names: frozenset[str] | None = None,
        parallel: bool = True,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self._ledger = CallLedger(
            names=names, parallel=parallel, new_id=new_id or type(self).NEW_ID
        )
        self.state: State = "start" if self.JSON_AT_START else "text"
        self._buffer = ""
        self._longest = max(map(len, self.OPENERS), default=0)
        #: In ``call``: its kind, and its JSON as it comes.
        self._kind: CallKind = "json"
        self._stream: CallStream | None = None
        #: The index of the call that went out and is being read (None:
        #: none; -1: one not released, past the calls asked for).
        self._live: int | None = None
        #: In ``answer``: the generic answer's string.
        self._decoder: StringDecoder | None = None

    @property
    def calls_made(self) -> int:
        """How many calls were released."""
        return self._ledger.made

    def feed(self, text: str) -> ToolSplit:
        """Add a piece of final text."""
        if self.state == "done":
            return _NOTHING
        self._buffer += text
        content: list[str] = []
        calls: list[CallPart] = []
        while self._step(content, calls):
            pass
        return self._result(content, calls)

    def part(self, part: CallPart) -> ToolSplit:
        """A call the engine parsed itself: not this syntax's (see
        :class:`~wsserver.shaping.tool_relay.RelayedCalls`); nothing comes of it."""
        return _NOTHING

    def flush(self, *, cut: bool = False) -> ToolSplit:
        """The end of the output: release or judge what was held back.

        ``cut``: the output was cut off (``max_tokens``). A call it cut short
        is then released as far as it got — its name, and its arguments'
        text so far, which is not valid JSON — instead of being an error; a
        cut before the call's name leaves nothing to release."""
        content: list[str] = []
        calls: list[CallPart] = []
        state = self.state
        if state != "done":
            held, self._buffer = self._buffer, ""
            if state in ("start", "text"):
                self._release(held, content)
            elif state == "answer":
                pass  # an answer's string cut short (what it decided is out), or its "}" missing
            elif cut and self._cut_call_in(held):
                self._cut_call(calls)
            elif self._kind == "json" and '"name"' not in held and not self._named():
                content.append(held)  # JSON that never looked like a call: the answer
            elif (end := json_extent(held)) > 0 and HERMES_END.startswith(held[end:].strip(_WS)):
                # A model that ended without (all of) the closing tag: the call is whole.
                self._body_end(held[:end], content, calls)
            else:
                self._fail("the model's tool call was cut off before its end")
        self.state = "done"
        return self._result(content, calls)

    # ------------------------------------------------------------ states

    def _result(self, content: list[str], calls: list[CallPart]) -> ToolSplit:
        error = self._ledger.take_error()
        if not content and not calls and error is None:
            return _NOTHING
        return ToolSplit("".join(content), tuple(calls), error)

    def _fail(self, message: str) -> None:
        self._ledger.fail(message)
        self.state = "done"
        self._buffer = ""
        self._stream = None

    def _step(self, content: list[str], calls: list[CallPart]) -> bool:
        """One move on the buffer; whether another may follow."""
        if not self._buffer:
            return False
        state = self.state
        if state == "call":
            return self._step_call(content, calls)
        if state == "answer":
            return self._step_answer(content)
        if state == "done":
            return False
        buffer = self._buffer
        if state == "start":
            stripped = buffer.lstrip(_WS)
            if not stripped:
                return False  # whitespace: a JSON call may still follow
            if stripped[0] == "{":
                self._open_call("json", stripped)
                return True
            if self._ledger.made and stripped[0] == ";":
                self._buffer = stripped[1:]
                return True
        first, found = len(buffer), ""
        for opener in self.OPENERS:
            at = buffer.find(opener)
            if 0 <= at < first:
                first, found = at, opener
        if found:
            self._release(buffer[:first], content)
            rest = buffer[first + len(found) :].lstrip(_WS)
            kind = self.OPENERS[found]
            if kind == "json":
                self.state = "start"  # the JSON call itself opens at the next "{"
                self._buffer = rest
            else:
                self._open_call(kind, rest)
            return True
        keep = self._held_back(buffer)
        self._release(buffer[: len(buffer) - keep], content)
        self._buffer = buffer[len(buffer) - keep :]
        return False

    def _open_call(self, kind: CallKind, buffer: str) -> None:
        self.state = "call"
        self._kind = kind
        self._buffer = buffer

    def _release(self, text: str, content: list[str]) -> None:
        if not text:
            return
        if self._ledger.made and not text.strip():
            return  # whitespace between a model's calls
        self.state = "text"
        content.append(text)

    def _held_back(self, text: str) -> int:
        """How much of the end of ``text`` may still become an opener."""
        for length in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(opener.startswith(tail) for opener in self.OPENERS):
                return length
        return 0

    def _step_answer(self, content: list[str]) -> bool:
        """Inside a generic ``{"response": "…"}``: its string's text is content
        as it comes; then its closing brace is taken."""
        decoder = self._decoder
        assert decoder is not None
        if not decoder.closed:
            text, end = decoder.feed(self._buffer)
            if text:
                content.append(text)
            if end is None:
                self._buffer = ""
                return False
            self._buffer = self._buffer[end:]
        rest = self._buffer.lstrip(_WS)
        if not rest:
            return False  # the brace may still come
        self._decoder = None
        self.state = "text"
        # More than the response in the object: what follows is the model's text.
        self._buffer = rest[1:] if rest[0] == "}" else rest
        return True

    def _step_call(self, content: list[str], calls: list[CallPart]) -> bool:
        kind = self._kind
        buffer = self._buffer
        if kind == "json" and (opened := _RESPONSE.match(buffer)) is not None:
            # llama.cpp's generic answer: its text streams, decoded as it comes.
            self.state = "answer"
            self._decoder = StringDecoder()
            self._buffer = buffer[opened.end() :]
            self._stream = None  # (it read the answer's start: no call)
            return True
        # A model's call: its parts go out as its JSON comes.
        if self._stream is None:
            self._stream = CallStream(kind)
        for found in self._stream.feed(buffer):
            self._found(found, calls)
            if self.state == "done":
                return False
        extent = self._stream.end
        if extent < 0:
            return False
        body, rest = buffer[:extent], buffer[extent:]
        if kind == "hermes":
            after = rest.lstrip(_WS)
            if len(after) < len(HERMES_END) and HERMES_END.startswith(after):
                return False  # the closing tag may still come
            if after.startswith(HERMES_END):
                rest = after[len(HERMES_END) :]
        self._buffer = rest
        # After a JSON call, more may follow (";"-separated, Llama 3.x).
        self.state = "start" if kind == "json" and self.JSON_AT_START else "text"
        self._body_end(body, content, calls)
        if not self._ledger.failed and self._ledger.full:
            self.state = "done"  # one call asked for: what follows is not read
            self._buffer = ""
        return True

    # ------------------------------------------------------------ calls

    def _found(self, found: Found, calls: list[CallPart]) -> None:
        """What the call's JSON told so far: a call's name, more of its
        arguments, or its end."""
        ledger = self._ledger
        if isinstance(found, Named):
            if ledger.full:
                self._live = -1  # one call asked for: this one is not read
            elif ledger.known(found.name):
                self._live = ledger.made
                ledger.made += 1
                call_id = found.call_id or ledger.new_id()
                calls.append(CallPart(self._live, "", call_id, found.name))
            else:
                self._fail_now()
        elif isinstance(found, Arguments):
            if self._live is not None and self._live >= 0:
                add_arguments(self._live, found.text, calls)
        else:
            self._ended(found, calls)

    def _fail_now(self) -> None:
        """The ledger refused the call: nothing more is read."""
        self.state = "done"
        self._buffer = ""
        self._stream = None

    def _ended(self, ended: Ended, calls: list[CallPart]) -> None:
        """A call object ended: checked as a whole call always was; its
        arguments go out now if they did not stream."""
        ledger = self._ledger
        live, self._live = self._live, None
        if live == -1 or (live is None and ledger.full):
            return  # past the calls asked for
        try:
            item = orjson.loads(ended.text)
        except orjson.JSONDecodeError:
            self._fail(f"the model's tool call is not valid JSON: {excerpt(ended.text)}")
            return
        checked = ledger.check(item)
        if checked is None:
            self._fail_now()
            return
        name, arguments, given = checked
        if live is None:
            ledger.emit(name, arguments, given, calls)
        elif not ended.streamed:
            add_arguments(live, arguments, calls)

    def _named(self) -> bool:
        """Whether the call being read was named."""
        return self._stream is not None and self._stream.named

    def _body_end(self, body: str, content: list[str], calls: list[CallPart]) -> None:
        """A model's call JSON ended: the calls in it went out as they came;
        it must still be valid JSON as a whole. JSON with no call object in
        it is read whole (the generic format's answer, or text)."""
        stream, self._stream = self._stream, None
        if stream is None or not stream.found:
            self._whole(body, content, calls)
            return
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            self._fail(f"the model's tool call is not valid JSON: {excerpt(body)}")

    def _whole(self, body: str, content: list[str], calls: list[CallPart]) -> None:
        """JSON in a call's place in which no call streamed, read whole."""
        kind = self._kind
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            if kind == "json" and '"name"' not in body:
                content.append(body)  # not a call: the answer is JSON-like text
                return
            self._fail(f"the model's tool call is not valid JSON: {excerpt(body)}")
            return
        items: list[Any]
        if kind == "mistral":
            items = value if isinstance(value, list) else [value]
        elif kind == "json" and isinstance(value, dict) and "name" not in value:
            if isinstance(value.get("tool_calls"), list):
                items = value["tool_calls"]
            elif isinstance(value.get("tool_call"), dict):
                items = [value["tool_call"]]
            elif isinstance(value.get("response"), str) and len(value) == 1:
                content.append(value["response"])
                return
            else:
                content.append(body)  # JSON, but not a call: it is the answer
                return
        else:
            items = [value]
        ledger = self._ledger
        for item in items:
            if ledger.full:
                return
            checked = ledger.check(item)
            if checked is None:
                self._fail_now()
                return
            ledger.emit(*checked, calls)

    def _cut_call_in(self, held: str) -> bool:
        """Whether ``held``, cut off inside a call, holds a model's call (a
        JSON output may also be an answer that only looks like one)."""
        if self._kind == "json":
            return '"tool_call' in held or '"name"' in held or self._named()
        return True  # Hermes' block, Mistral's array

    def _cut_call(self, calls: list[CallPart]) -> None:
        """The output was cut off inside a call's JSON: the calls it held
        whole went out checked, the one it cut short went out as far as it
        got — its arguments' text so far, which does not parse (the wire
        says the output was cut, and clients see why the arguments do not
        parse). Only arguments written as a JSON string, which do not
        stream, go out now. A call cut before its name is complete has no
        part to release."""
        if self._stream is not None and self._live is not None and self._live >= 0:
            add_arguments(self._live, self._stream.cut_arguments(), calls)

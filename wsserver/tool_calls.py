"""A model's tool calls, parsed out of its text (sans-I/O).

Models call tools by writing a call in their template's syntax. Which syntax
is read from the chat template's text, the way llama.cpp's ``common/chat.cpp``
tells formats apart (:func:`detect_syntax`):

* ``hermes`` — Hermes 2 Pro, Qwen 2.5/3: ``<tool_call>{"name": …,
  "arguments": {…}}</tool_call>``, one block per call, after any text;
* ``llama3`` — Llama 3.1-3.3: the whole output is one JSON call
  ``{"name": …, "parameters": {…}}`` (or ``arguments``), maybe after
  ``<|python_tag|>``; several may follow, separated by ``;``;
* ``mistral`` — ``[TOOL_CALLS][{"name": …, "arguments": {…}, "id": …}, …]``
  after any text;
* ``generic`` — templates that know no tools (llama.cpp's generic format):
  the whole output is JSON, ``{"tool_call": {…}}``, ``{"tool_calls": […]}``,
  ``{"response": "…"}`` or a bare call object;
* ``any`` — all of the above (an engine without a template: the fake);
* ``relay`` — calls an upstream server already parsed and streamed as
  OpenAI's ``tool_calls``: the relay writes each part into the text as it
  arrives, as :data:`RELAY_MARKER` and a JSON object
  (:func:`relay_part_text`), so that they take the same path as every
  engine's calls (paced, numbered, replayed) while the upstream's content is
  left exactly as it was (no model syntax is looked for in it). Those parts
  are released at once, as they came — the arguments' fragments too — and
  each call's joined arguments are checked at the end
  (:class:`~wsserver.tool_relay.RelayedCalls`).

:class:`ToolCallParser` works on final text, after
:class:`~wsserver.reasoning.ReasoningSplitter`, like it: piece by piece, and
it holds back exactly what may still become a call — ``"<tool_c"`` at the
end of content, leading whitespace and ``{`` where a JSON call may begin — so
a marker split anywhere is still found and released text is never taken back.
Text before a call is content; once a call begins its text is not content.
The generic answer ``{"response": "…"}`` is content as its string comes,
decoded piece by piece (:class:`~wsserver.json_text.StringDecoder`), not
once its JSON closes. A model's call streams as its JSON is written
(:class:`~wsserver.call_stream.CallStream` follows it): its first part — id
and ``name``, one of the request's tools — as soon as the name is read, then
the raw text of its ``arguments`` object as it comes, in fragments of at
most :data:`FRAGMENT_CHARS` (:mod:`wsserver.call_parts`) that join to
exactly the model's JSON text. When the call's JSON ends it is checked
whole, as it always was: a call that is not valid JSON, names no known tool,
or whose arguments are not a JSON object is an :attr:`ToolSplit.error` —
after the parts already released, as for a relayed call — never passed off
as a call; the parser then takes nothing more. Arguments written as a JSON
string (holding the object) are released at the call's end, whole, as JSON.
A call the output was cut off in (``max_tokens``:
:meth:`ToolCallParser.flush` with ``cut``) is as far as it got — its name
and its arguments' text so far, as OpenAI reports such a call: the answer's
``length`` says it is cut, and its arguments do not parse.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from .call_parts import (
    FRAGMENT_CHARS,
    CallPart,
    call_parts,
    new_call_id,
    new_mistral_call_id,
    unknown_tool,
)
from .call_stream import Arguments, CallStream, Ended, Found, Named
from .json_text import StringDecoder, json_extent
from .tool_relay import RELAY_MARKER, RelayedCalls, relay_part_text

__all__ = [
    "FRAGMENT_CHARS",
    "MARKERS",
    "RELAY_MARKER",
    "SYNTAXES",
    "CallPart",
    "ToolCallParser",
    "ToolSplit",
    "detect_syntax",
    "new_call_id",
    "relay_part_text",
]

Syntax = Literal["hermes", "llama3", "mistral", "generic", "any", "relay"]
SYNTAXES: Final = ("hermes", "llama3", "mistral", "generic", "any", "relay")

_HERMES: Final = "<tool_call>"
_HERMES_END: Final = "</tool_call>"
_MISTRAL: Final = "[TOOL_CALLS]"
_PYTHON_TAG: Final = "<|python_tag|>"
#: The markers the parser reads in a model's text: an engine must render them
#: as text even where its vocabulary makes them control tokens.
MARKERS: Final = (_HERMES, _HERMES_END, _MISTRAL, _PYTHON_TAG)


def detect_syntax(template: str | None) -> Syntax:
    """The call syntax a chat template's text teaches its model."""
    if template is None:
        return "any"
    if _HERMES in template:
        return "hermes"
    if _MISTRAL in template:
        return "mistral"
    if _PYTHON_TAG in template or ("<|start_header_id|>" in template and "ipython" in template):
        return "llama3"
    return "generic"


@dataclass(frozen=True, slots=True)
class ToolSplit:
    """What a piece of text became: content, then call parts (either may be empty)."""

    content: str = ""
    calls: tuple[CallPart, ...] = ()
    #: Why the model's call is refused (then nothing more is parsed).
    error: str | None = None


_Kind = Literal["hermes", "mistral", "json", "relay"]
_WS = " \t\r\n"


class ToolCallParser:
    """Splits a stream of text into content and tool calls."""

    __slots__ = (
        "_answer",
        "_at_start",
        "_buffer",
        "_call_kind",
        "_done",
        "_error",
        "_live",
        "_made",
        "_max_calls",
        "_names",
        "_new_id",
        "_openers",
        "_relay",
        "_start_json",
        "_stream",
    )

    def __init__(
        self,
        syntax: Syntax,
        *,
        names: frozenset[str] | None = None,
        parallel: bool = True,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        if syntax not in SYNTAXES:
            raise ValueError(f"unknown tool call syntax {syntax!r}")
        if new_id is None:
            # A fresh id in the shape the model's template takes back.
            new_id = new_mistral_call_id if syntax == "mistral" else new_call_id
        openers: dict[str, _Kind] = {}
        if syntax in ("hermes", "any"):
            openers[_HERMES] = "hermes"
        if syntax in ("mistral", "any"):
            openers[_MISTRAL] = "mistral"
        if syntax in ("llama3", "any"):
            openers[_PYTHON_TAG] = "json"
        if syntax == "relay":
            openers[RELAY_MARKER] = "relay"  # a JSON object: one part of a call
        self._openers = openers
        #: A JSON call may open the output (after whitespace).
        self._start_json = syntax in ("llama3", "generic", "any")
        self._names = names
        self._max_calls = None if parallel else 1
        self._new_id = new_id
        self._buffer = ""
        self._at_start = True
        self._call_kind: _Kind | None = None
        self._made = 0
        self._done = False
        self._error: str | None = None
        #: The calls an upstream streamed (the ``relay`` syntax).
        self._relay = (
            RelayedCalls(names=names, max_calls=self._max_calls, new_id=new_id)
            if syntax == "relay"
            else None
        )
        #: Inside the string of a generic ``{"response": "…"}``: its decoder.
        self._answer: StringDecoder | None = None
        #: Inside a model's call: its JSON as it comes, and the index of the
        #: call that went out and is being read (None: none; -1: one not
        #: released, past the calls asked for).
        self._stream: CallStream | None = None
        self._live: int | None = None

    @property
    def calls_made(self) -> int:
        """How many calls were released."""
        return self._made

    def feed(self, text: str) -> ToolSplit:
        """Add a piece of final text."""
        if self._done:
            return ToolSplit()
        self._buffer += text
        content: list[str] = []
        calls: list[CallPart] = []
        while self._step(content, calls):
            pass
        return self._result(content, calls)

    def flush(self, *, cut: bool = False) -> ToolSplit:
        """The end of the output: release or judge what was held back.

        ``cut``: the output was cut off (``max_tokens``). A call it cut short
        is then released as far as it got — its name, and its arguments'
        text so far, which is not valid JSON — instead of being an error; a
        cut before the call's name leaves nothing to release."""
        content: list[str] = []
        calls: list[CallPart] = []
        if not self._done:
            held, self._buffer = self._buffer, ""
            if self._answer is not None:
                pass  # an answer's string cut short (what it decided is out), or its "}" missing
            elif self._call_kind is None:
                self._release(held, content)
            elif cut and self._cut_call_in(held):
                self._cut_call(calls)
            elif self._call_kind == "json" and '"name"' not in held and not self._named():
                content.append(held)  # JSON that never looked like a call: the answer
            elif json_extent(held) > 0 and _HERMES_END.startswith(
                held[json_extent(held) :].strip(_WS)
            ):
                # A model that ended without (all of) the closing tag: the call is whole.
                self._body_end(held[: json_extent(held)], self._call_kind, content, calls)
            else:
                self._fail("the model's tool call was cut off before its end")
        if self._relay is not None and not self._done:
            # An upstream's calls: each one's joined arguments are checked now.
            parts, error = self._relay.end(cut=cut)
            calls.extend(parts)
            if error is not None:
                self._fail(error)
        self._done = True
        return self._result(content, calls)

    # ------------------------------------------------------------ steps

    def _result(self, content: list[str], calls: list[CallPart]) -> ToolSplit:
        error, self._error = self._error, None
        return ToolSplit("".join(content), tuple(calls), error)

    def _fail(self, message: str) -> None:
        self._error = message
        self._done = True
        self._buffer = ""
        self._stream = None

    def _step(self, content: list[str], calls: list[CallPart]) -> bool:
        """One move on the buffer; whether another may follow."""
        if self._done or not self._buffer:
            return False
        if self._answer is not None:
            return self._step_answer(content)
        if self._call_kind is not None:
            return self._step_call(content, calls)
        buffer = self._buffer
        if self._at_start and self._start_json:
            stripped = buffer.lstrip(_WS)
            if not stripped:
                return False  # whitespace: a JSON call may still follow
            if stripped[0] in "{":
                self._at_start = False
                self._call_kind = "json"
                self._buffer = stripped
                return True
            if self._made and stripped[0] == ";":
                self._buffer = stripped[1:]
                return True
        first, kind = len(buffer), None
        for opener, opener_kind in self._openers.items():
            at = buffer.find(opener)
            if 0 <= at < first:
                first, kind = at, opener_kind
        if kind is not None:
            opener_len = next(len(o) for o, k in self._openers.items() if k == kind)
            self._release(buffer[:first], content)
            self._buffer = buffer[first + opener_len :].lstrip(_WS)
            self._call_kind = kind
            self._at_start = kind == "json"
            if kind == "json":
                self._call_kind = None  # the JSON call itself opens at the next "{"
            return True
        keep = _held_back(buffer, self._openers)
        self._release(buffer[: len(buffer) - keep], content)
        self._buffer = buffer[len(buffer) - keep :]
        return False

    def _release(self, text: str, content: list[str]) -> None:
        if not text:
            return
        if self._made and not text.strip() and RELAY_MARKER not in self._openers:
            return  # whitespace between a model's calls (an upstream's content is kept)
        self._at_start = False
        content.append(text)

    def _step_answer(self, content: list[str]) -> bool:
        """Inside a generic ``{"response": "…"}``: its string's text is content
        as it comes; then its closing brace is taken."""
        assert self._answer is not None
        if not self._answer.closed:
            text, end = self._answer.feed(self._buffer)
            if text:
                content.append(text)
            if end is None:
                self._buffer = ""
                return False
            self._buffer = self._buffer[end:]
        rest = self._buffer.lstrip(_WS)
        if not rest:
            return False  # the brace may still come
        self._answer = None
        # More than the response in the object: what follows is the model's text.
        self._buffer = rest[1:] if rest[0] == "}" else rest
        return True

    def _step_call(self, content: list[str], calls: list[CallPart]) -> bool:
        kind = self._call_kind
        buffer = self._buffer
        if kind == "json" and (opened := _RESPONSE.match(buffer)) is not None:
            # llama.cpp's generic answer: its text streams, decoded as it comes.
            self._call_kind = None
            self._at_start = False
            self._answer = StringDecoder()
            self._buffer = buffer[opened.end() :]
            self._stream = None  # (it read the answer's start: no call)
            return True
        if kind == "relay":
            extent = json_extent(buffer)
        else:
            # A model's call: its parts go out as its JSON comes.
            if self._stream is None:
                assert kind is not None
                self._stream = CallStream(kind)
            for found in self._stream.feed(buffer):
                self._found(found, calls)
                if self._done:
                    return False
            extent = self._stream.end
        if extent < 0:
            return False
        body, rest = buffer[:extent], buffer[extent:]
        if kind == "hermes":
            after = rest.lstrip(_WS)
            if len(after) < len(_HERMES_END) and _HERMES_END.startswith(after):
                return False  # the closing tag may still come
            if after.startswith(_HERMES_END):
                rest = after[len(_HERMES_END) :]
        self._buffer = rest
        self._call_kind = None
        if kind == "relay":
            self._relay_part(body, calls)
            return True
        self._body_end(body, kind, content, calls)
        if self._max_calls is not None and self._made >= self._max_calls:
            self._done = True  # one call asked for: what follows is not read
            self._buffer = ""
        # After a JSON call, more may follow (";"-separated, Llama 3.x).
        self._at_start = kind == "json" and self._start_json
        return True

    def _found(self, found: Found, calls: list[CallPart]) -> None:
        """What the call's JSON told so far: a call's name, more of its
        arguments, or its end."""
        if isinstance(found, Named):
            if self._max_calls is not None and self._made >= self._max_calls:
                self._live = -1  # one call asked for: this one is not read
            elif self._known(found.name):
                self._live = self._made
                self._made += 1
                calls.append(CallPart(self._live, "", found.call_id or self._new_id(), found.name))
        elif isinstance(found, Arguments):
            if self._live is not None and self._live >= 0:
                _add_arguments(self._live, found.text, calls)
        else:
            self._ended(found, calls)

    def _ended(self, ended: Ended, calls: list[CallPart]) -> None:
        """A call object ended: checked as a whole call always was; its
        arguments go out now if they did not stream."""
        live, self._live = self._live, None
        if live == -1 or (
            live is None and self._max_calls is not None and self._made >= self._max_calls
        ):
            return  # past the calls asked for
        try:
            item = orjson.loads(ended.text)
        except orjson.JSONDecodeError:
            self._fail(f"the model's tool call is not valid JSON: {_excerpt(ended.text)}")
            return
        checked = self._check(item)
        if checked is None:
            return
        name, arguments, given = checked
        if live is None:
            self._emit(name, arguments, given or self._new_id(), calls)
        elif not ended.streamed:
            _add_arguments(live, arguments, calls)

    def _named(self) -> bool:
        """Whether the call being read was named."""
        return self._stream is not None and self._stream.named

    def _body_end(
        self, body: str, kind: _Kind | None, content: list[str], calls: list[CallPart]
    ) -> None:
        """A model's call JSON ended: the calls in it went out as they came;
        it must still be valid JSON as a whole. JSON with no call object in
        it is read whole (the generic format's answer, or text)."""
        stream, self._stream = self._stream, None
        if stream is None or not stream.found:
            self._call(body, kind, content, calls)
            return
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            self._fail(f"the model's tool call is not valid JSON: {_excerpt(body)}")

    def _call(
        self, body: str, kind: _Kind | None, content: list[str], calls: list[CallPart]
    ) -> None:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            if kind == "json" and '"name"' not in body:
                content.append(body)  # not a call: the answer is JSON-like text
                return
            self._fail(f"the model's tool call is not valid JSON: {_excerpt(body)}")
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
        for item in items:
            if self._max_calls is not None and self._made >= self._max_calls:
                return
            part = self._check(item)
            if part is None:
                return
            self._emit(part[0], part[1], part[2] or self._new_id(), calls)

    def _emit(self, name: str, arguments: str, call_id: str, calls: list[CallPart]) -> None:
        """Release a call: its first part, then its arguments in fragments."""
        calls.extend(call_parts(self._made, arguments, call_id, name))
        self._made += 1

    def _relay_part(self, body: str, calls: list[CallPart]) -> None:
        """One part of a call an upstream streamed: released as it came."""
        assert self._relay is not None
        parts, error = self._relay.part(body)
        calls.extend(parts)
        self._made = self._relay.made
        if error is not None:
            self._fail(error)

    def _cut_call_in(self, held: str) -> bool:
        """Whether ``held``, cut off inside a call, holds a model's call (a
        JSON output may also be an answer that only looks like one)."""
        if self._call_kind == "json":
            return '"tool_call' in held or '"name"' in held or self._named()
        return self._call_kind in ("hermes", "mistral")  # (a relay writes whole parts)

    def _cut_call(self, calls: list[CallPart]) -> None:
        """The output was cut off inside a call's JSON: the calls it held
        whole went out checked, the one it cut short went out as far as it
        got — its arguments' text so far, which does not parse (the wire
        says the output was cut, and clients see why the arguments do not
        parse). Only arguments written as a JSON string, which do not
        stream, go out now. A call cut before its name is complete has no
        part to release."""
        if self._stream is not None and self._live is not None and self._live >= 0:
            _add_arguments(self._live, self._stream.cut_arguments(), calls)

    def _known(self, name: str) -> bool:
        """Whether ``name`` is one of the request's tools (failing if not)."""
        refused = unknown_tool(name, self._names)
        if refused is not None:
            self._fail(refused)
        return refused is None

    def _check(self, item: Any) -> tuple[str, str, str | None] | None:
        """A call's name, arguments (JSON text) and id (if it has one); None
        after failing."""
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            self._fail(f"the model's tool call names no function: {_excerpt(str(item))}")
            return None
        name: str = item["name"]
        if not self._known(name):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                self._fail(f"the arguments of the model's call to {name!r} are not valid JSON")
                return None
        if not isinstance(arguments, dict):
            self._fail(f"the arguments of the model's call to {name!r} are not a JSON object")
            return None
        given = item.get("id")
        call_id = given if isinstance(given, str) and given else None
        return name, orjson.dumps(arguments).decode(), call_id


def _add_arguments(index: int, text: str, calls: list[CallPart]) -> None:
    """More arguments of call ``index``: joined to its last part if that is
    the last of ``calls`` (up to :data:`FRAGMENT_CHARS`), else new parts."""
    while text:
        last = calls[-1] if calls else None
        if last is not None and last.index == index and len(last.arguments) < FRAGMENT_CHARS:
            room = FRAGMENT_CHARS - len(last.arguments)
            calls[-1] = dataclasses.replace(last, arguments=last.arguments + text[:room])
        else:
            room = FRAGMENT_CHARS
            calls.append(CallPart(index, text[:room]))
        text = text[room:]


def _held_back(text: str, openers: dict[str, _Kind]) -> int:
    """How much of the end of ``text`` may still become an opener."""
    for length in range(min(max(map(len, openers), default=0) - 1, len(text)), 0, -1):
        tail = text[-length:]
        if any(opener.startswith(tail) for opener in openers):
            return length
    return 0


#: What opens llama.cpp's generic answer, ``{"response": "…"}``, up to its string.
_RESPONSE: Final = re.compile(r'\{\s*"response"\s*:\s*"')


_SPACES = re.compile(r"\s+")


def _excerpt(text: str) -> str:
    text = _SPACES.sub(" ", text).strip()
    return repr(text[:80] + ("…" if len(text) > 80 else ""))

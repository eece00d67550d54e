"""One Messages API answer, rendered (sans-I/O).

A :class:`MessageRender` turns what the request driver gives back — the start,
each ``delta``'s reasoning, text and tool call parts, the ``done`` — into
Anthropic's stream events and into the ``message`` object (the whole body
without ``stream``). The order of a message's events, each sent as SSE with
its ``event:`` name::

    ping ...                                        (while the request waits)
    message_start                                   (once the engine is ours)
    per content block, in the order the model wrote them, indices 0, 1, …:
      content_block_start, content_block_delta ..., content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop
    error                                           (instead, when it failed)

The blocks: ``thinking`` (the reasoning, ``thinking_delta``; closed by a
``signature_delta`` with :data:`SIGNATURE`, the empty string: nothing is
signed here, and thinking blocks sent back are not checked), ``text``
(``text_delta``) and ``tool_use`` (started with its ``id`` — the core's call
id with ``toolu_`` for ``call_`` — ``name`` and ``input`` ``{}``, then the
arguments' JSON text as ``input_json_delta`` ``partial_json`` fragments; the
object's ``input`` is that text parsed — or ``{}`` for a call that
``max_tokens`` cut short, whose text does not parse: ``stop_reason``
``max_tokens`` says so, and the streamed fragments are as far as it got). A
message that produced nothing has no block.

``message_start`` waits for the engine's count of the prompt
(:meth:`MessageRender.prompt_counted`, once it has read it) and goes out with
the first block — never later than the first token, which comes after the
prompt — so its ``usage`` has the real input counts; an engine that counts
the prompt only at the end (an upstream's usage) leaves them 0 there.
``message_delta``'s usage has them again, which the SDKs take as the total.
As Anthropic counts them, ``input_tokens`` are the prompt tokens the engine
had to read and ``cache_read_input_tokens`` those it reused from its prefix
cache (together the prompt, what ``count_tokens`` says); ``output_tokens`` counts every generated token, the reasoning's too
(as Anthropic counts thinking). ``stop_reason`` is
``end_turn``, ``max_tokens``, ``stop_sequence`` (with ``stop_sequence`` the
string that matched) or ``tool_use``.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from ...core.protocol import CallPart, Delta, Done
from ..exchange import Failure, Renderer, sse, sse_events
from .api import MessagesRequest, anthropic_status, error_object, refusal_wording
from .content import forced_call_refusal

__all__ = [
    "PING",
    "SIGNATURE",
    "MessageAnswer",
    "MessageRender",
    "sse",
    "stop_reason",
    "tool_use_id",
]

#: A thinking block's ``signature``: nothing is signed here.
SIGNATURE: Final = ""


def tool_use_id(call_id: str | None) -> str:
    """A call's id as Anthropic writes it (``toolu_…``)."""
    call_id = call_id or ""
    return "toolu_" + call_id.removeprefix("call_")


#: The keep-alive a waiting stream gets (the SDKs skip it).
PING: Final = sse({"type": "ping"})


def stop_reason(done: Done, stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    """Why a message that ran to its end stopped, Anthropic's way, and the
    stop sequence that ended it. Only one of the request's ``stop_sequences``
    is one: a stop string the engine added itself (a prompt format's end of
    turn, when the model has no chat template) is the model ending its turn."""
    if done.reason == "length":
        return "max_tokens", None
    if done.reason == "tool_calls":
        return "tool_use", None
    if done.stop_sequence is not None and done.stop_sequence in stop_sequences:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


#: Where a step appends the events that tell it (None: it makes none).
_Events = list[dict[str, Any]] | None
_Calls = tuple[CallPart, ...] | None

_DELTAS: Final = {
    "thinking": "thinking_delta",
    "text": "text_delta",
    "tool_use": "input_json_delta",
}
_FIELDS: Final = {"thinking": "thinking", "text": "text", "tool_use": "partial_json"}


class MessageRender:
    """The events and the object of one message."""

    def __init__(self, request: MessagesRequest, *, message_id: str, model: str) -> None:
        self.request = request
        self.id = message_id
        self.model = model
        #: The content blocks so far, each with its text (a tool's input as JSON text).
        self.blocks: list[dict[str, Any]] = []
        self._parts: list[list[str]] = []
        #: The block of each call index of the core's parts.
        self._calls: dict[int, int] = {}
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.input_tokens = 0
        self.cache_read_input_tokens = 0
        self.output_tokens = 0
        self._begun = False
        self._open = False

    @property
    def text(self) -> str:
        return "".join(
            "".join(parts)
            for block, parts in zip(self.blocks, self._parts, strict=True)
            if block["type"] == "text"
        )

    # ------------------------------------------------------------ events

    def prompt_counted(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The engine counted the prompt: ``message_start``'s usage has it."""
        self.cache_read_input_tokens = cached_tokens
        self.input_tokens = prompt_tokens - cached_tokens

    def begin(self) -> list[dict[str, Any]]:
        """``message_start`` (once)."""
        if self._begun:
            return []
        self._begun = True
        return [{"type": "message_start", "message": self.message()}]

    def delta(
        self,
        text: str,
        reasoning: str | None = None,
        tool_calls: tuple[CallPart, ...] | None = None,
    ) -> list[dict[str, Any]]:
        """One delta: its reasoning, its text, its call parts, each in its block
        (the message starts before the first, a block when its kind changes)."""
        events = self.begin()
        self._take(text, reasoning, tool_calls, events)
        return events

    def gather(
        self,
        text: str,
        reasoning: str | None = None,
        tool_calls: tuple[CallPart, ...] | None = None,
    ) -> None:
        """One delta for the ``message`` object alone (a whole body): its blocks
        grow as with :meth:`delta`, and no event is made."""
        self._take(text, reasoning, tool_calls, None)

    # Each step changes the blocks, then — given a list (``events``), for a
    # stream — appends the events that tell it; given None, makes none.

    def _take(self, text: str, reasoning: str | None, calls: _Calls, events: _Events) -> None:
        if reasoning:
            self._add("thinking", reasoning, None, events)
        if text:
            self._add("text", text, None, events)
        for part in calls or ():
            if part.name is not None:
                self._close(events)
                self._calls[part.index] = len(self.blocks)
                start = {"type": "tool_use", "id": tool_use_id(part.id), "name": part.name}
                self._start({**start, "input": {}}, events)
            if part.arguments:
                self._add("tool_use", part.arguments, self._calls[part.index], events)

    def _add(self, kind: str, text: str, index: int | None, events: _Events) -> None:
        if index is None and not (self._open and self.blocks[-1]["type"] == kind):
            self._close(events)
            self._start(
                {"type": kind, kind: "", "signature": SIGNATURE}
                if kind == "thinking"
                else {"type": kind, kind: ""},
                events,
            )
        at = len(self.blocks) - 1 if index is None else index
        self._parts[at].append(text)
        if events is not None:
            delta = {"type": _DELTAS[kind], _FIELDS[kind]: text}
            events.append({"type": "content_block_delta", "index": at, "delta": delta})

    def _start(self, block: dict[str, Any], events: _Events) -> None:
        self.blocks.append(block)
        self._parts.append([])
        self._open = True
        if events is not None:
            index = len(self.blocks) - 1
            events.append({"type": "content_block_start", "index": index, "content_block": block})

    def _close(self, events: _Events) -> None:
        if not self._open:
            return
        self._open = False
        if events is None:
            return
        index = len(self.blocks) - 1
        if self.blocks[index]["type"] == "thinking":
            delta = {"type": "signature_delta", "signature": SIGNATURE}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})

    def end(self, done: Done) -> list[dict[str, Any]]:
        """A message that ran to its end: its block closed, its stop reason and usage."""
        self._ended(done)
        events = self.begin()
        self._close(events)
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": self.usage(),
            }
        )
        events.append({"type": "message_stop"})
        return events

    def finish(self, done: Done) -> None:
        """The end for the ``message`` object alone (a whole body): no event."""
        self._ended(done)
        self._close(None)

    def _ended(self, done: Done) -> None:
        self.stop_reason, self.stop_sequence = stop_reason(done, self.request.stop_sequences)
        # Anthropic counts the prompt's cached part apart from the rest.
        self.cache_read_input_tokens = done.usage.cached_tokens
        self.input_tokens = done.usage.prompt_tokens - done.usage.cached_tokens
        self.output_tokens = done.usage.completion_tokens

    # ------------------------------------------------------------ the object

    def content(self) -> list[dict[str, Any]]:
        """The content blocks, whole."""
        content = []
        for block, parts in zip(self.blocks, self._parts, strict=True):
            text = "".join(parts)
            if block["type"] == "tool_use":
                content.append({**block, "input": _input(text)})
            else:
                content.append({**block, block["type"]: text})
        return content

    def message(self) -> dict[str, Any]:
        """The ``message`` object as it stands (its content once it ended)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content() if self.stop_reason is not None else [],
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(),
        }

    def usage(self) -> dict[str, int]:
        """``usage`` as it stands, in Anthropic's terms."""
        return {
            "input_tokens": self.input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "output_tokens": self.output_tokens,
        }


def _input(text: str) -> Any:
    """A ``tool_use`` block's ``input``: its arguments' JSON text parsed; ``{}``
    for none, or for a call cut short by ``max_tokens`` (its text does not
    parse; ``stop_reason`` is ``max_tokens``)."""
    try:
        return orjson.loads(text) if text else {}
    except orjson.JSONDecodeError:
        return {}


class MessageAnswer(Renderer):
    """One ``POST /v1/messages`` answered on the HTTP exchange: Anthropic's
    events as SSE (a ``ping`` while it waits), or the ``message`` object as the
    body. Every failure is Anthropic's error object with Anthropic's status
    (:func:`~wsserver.dialects.anthropic.api.anthropic_status`): the whole answer, or an
    ``error`` event once the stream began."""

    keepalive = PING

    def __init__(self, render: MessageRender, *, forced: bool = False) -> None:
        self.render = render
        self.stream = render.request.stream
        #: The request forces a tool call (``any`` or a named tool).
        self._forced = forced

    def prompt_counted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.render.prompt_counted(prompt_tokens, cached_tokens)

    def refusal_wording(self, message: str) -> str:
        message = refusal_wording(message)
        if self._forced and "'tool_choice'" in message:
            # The engine cannot force a call: say so the Messages API's way.
            message = forced_call_refusal(self.render.model).message
        return message

    def chunk(self, delta: Delta) -> bytes:
        return sse_events(self.render.delta(delta.text, delta.reasoning, delta.tool_calls))

    def last(self, done: Done) -> bytes:
        return sse_events(self.render.end(done))

    def error_event(self, failure: Failure) -> bytes:
        return sse(self._error(failure)[1])

    def gather(self, delta: Delta) -> None:
        self.render.gather(delta.text, delta.reasoning, delta.tool_calls)

    def body(self, done: Done) -> bytes:
        self.render.finish(done)
        return orjson.dumps(self.render.message())

    def error_body(self, failure: Failure) -> tuple[int, bytes]:
        status, error = self._error(failure)
        return status, orjson.dumps(error)

    @staticmethod
    def _error(failure: Failure) -> tuple[int, dict[str, Any]]:
        status = anthropic_status(failure.status, failure.code)
        return status, error_object(status, failure.message)

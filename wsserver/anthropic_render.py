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

from .anthropic_api import MessagesRequest, error_object
from .protocol import CallPart, Done

__all__ = ["PING", "SIGNATURE", "MessageRender", "sse", "stop_reason", "tool_use_id"]

#: A thinking block's ``signature``: nothing is signed here.
SIGNATURE: Final = ""


def tool_use_id(call_id: str | None) -> str:
    """A call's id as Anthropic writes it (``toolu_…``)."""
    call_id = call_id or ""
    return "toolu_" + call_id.removeprefix("call_")


def sse(event: dict[str, Any]) -> bytes:
    """One event as Server-Sent Events: its ``event:`` name, its JSON."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


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
        if reasoning:
            events += self._add("thinking", reasoning)
        if text:
            events += self._add("text", text)
        for part in tool_calls or ():
            if part.name is not None:
                events += self._close()
                self._calls[part.index] = len(self.blocks)
                start = {"type": "tool_use", "id": tool_use_id(part.id), "name": part.name}
                events += self._start({**start, "input": {}})
            if part.arguments:
                events += self._add("tool_use", part.arguments, self._calls[part.index])
        return events

    def _add(self, kind: str, text: str, index: int | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if index is None and not (self._open and self.blocks[-1]["type"] == kind):
            events += self._close()
            events += self._start(
                {"type": kind, kind: "", "signature": SIGNATURE}
                if kind == "thinking"
                else {"type": kind, kind: ""}
            )
        at = len(self.blocks) - 1 if index is None else index
        self._parts[at].append(text)
        delta = {"type": _DELTAS[kind], _FIELDS[kind]: text}
        events.append({"type": "content_block_delta", "index": at, "delta": delta})
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        self._parts.append([])
        self._open = True
        index = len(self.blocks) - 1
        return [{"type": "content_block_start", "index": index, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        index = len(self.blocks) - 1
        events: list[dict[str, Any]] = []
        if self.blocks[index]["type"] == "thinking":
            delta = {"type": "signature_delta", "signature": SIGNATURE}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
        return events

    def end(self, done: Done) -> list[dict[str, Any]]:
        """A message that ran to its end: its block closed, its stop reason and usage."""
        self.stop_reason, self.stop_sequence = stop_reason(done, self.request.stop_sequences)
        # Anthropic counts the prompt's cached part apart from the rest.
        self.cache_read_input_tokens = done.usage.cached_tokens
        self.input_tokens = done.usage.prompt_tokens - done.usage.cached_tokens
        self.output_tokens = done.usage.completion_tokens
        events = self.begin()
        events += self._close()
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": self.usage(),
            }
        )
        events.append({"type": "message_stop"})
        return events

    @staticmethod
    def error_event(status: int, message: str) -> dict[str, Any]:
        """An ``error`` event (a failure after the stream began)."""
        return error_object(status, message)

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

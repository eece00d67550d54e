"""One Messages API answer, rendered (sans-I/O).

A :class:`MessageRender` turns what the request driver gives back — the start,
each ``delta``'s text, the ``done`` — into Anthropic's stream events and into
the ``message`` object (the whole body without ``stream``). The order of a
message's events, each sent as SSE with its ``event:`` name::

    ping ...                                        (while the request waits)
    message_start                                   (once the engine is ours)
    content_block_start (text), content_block_delta (text_delta) ...   (first text)
    content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop
    error                                           (instead, when it failed)

``usage.input_tokens`` is 0 in ``message_start`` (the prompt is counted once
the engine has read it) and the real count in ``message_delta``'s usage, which
the SDKs take as the total. A message that produced no text has no content
block. ``stop_reason`` is ``end_turn``, ``max_tokens`` or ``stop_sequence``
(with ``stop_sequence`` the string that matched).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from .anthropic_api import MessagesRequest, error_object
from .protocol import Done

__all__ = ["PING", "MessageRender", "sse", "stop_reason"]


def sse(event: dict[str, Any]) -> bytes:
    """One event as Server-Sent Events: its ``event:`` name, its JSON."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


#: The keep-alive a waiting stream gets (the SDKs skip it).
PING: Final = sse({"type": "ping"})


def stop_reason(done: Done) -> str:
    """Why a message that ran to its end stopped, Anthropic's way."""
    if done.reason == "length":
        return "max_tokens"
    if done.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


class MessageRender:
    """The events and the object of one message."""

    def __init__(self, request: MessagesRequest, *, message_id: str, model: str) -> None:
        self.request = request
        self.id = message_id
        self.model = model
        self.text_parts: list[str] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.input_tokens = 0
        self.output_tokens = 0
        self._begun = False
        self._block_open = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    # ------------------------------------------------------------ events

    def begin(self) -> list[dict[str, Any]]:
        """``message_start`` (once)."""
        if self._begun:
            return []
        self._begun = True
        return [{"type": "message_start", "message": self.message()}]

    def delta(self, text: str) -> list[dict[str, Any]]:
        """One text delta (the message and its text block start before the first)."""
        events = self.begin()
        if not self._block_open:
            self._block_open = True
            events.append(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
            )
        self.text_parts.append(text)
        events.append(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
            }
        )
        return events

    def end(self, done: Done) -> list[dict[str, Any]]:
        """A message that ran to its end: its block closed, its stop reason and usage."""
        self.stop_reason = stop_reason(done)
        self.stop_sequence = done.stop_sequence
        self.input_tokens = done.usage.prompt_tokens
        self.output_tokens = done.usage.completion_tokens
        events = self.begin()
        if self._block_open:
            events.append({"type": "content_block_stop", "index": 0})
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens},
            }
        )
        events.append({"type": "message_stop"})
        return events

    @staticmethod
    def error_event(status: int, message: str) -> dict[str, Any]:
        """An ``error`` event (a failure after the stream began)."""
        return error_object(status, message)

    # ------------------------------------------------------------ the object

    def message(self) -> dict[str, Any]:
        """The ``message`` object as it stands."""
        ended = self.stop_reason is not None and self._block_open
        content = [{"type": "text", "text": self.text}] if ended else []
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens},
        }

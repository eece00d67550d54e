"""One response of the Responses API, rendered (sans-I/O).

A :class:`ResponseRender` turns what the request driver gives back — the
start, each ``delta``'s text, the ``done`` — into the Responses API's typed
events, numbered by ``sequence_number`` from 0, and into the ``response``
object itself (the whole body without ``stream``, ``GET /v1/responses/{id}``).
The same events go out as SSE (:func:`sse`) over HTTP and as JSON text
messages in WebSocket mode (each with the ``stream_id`` of its lane, if any).

The order of a response's events::

    response.created, response.in_progress          (once the engine is ours)
    response.output_item.added, response.content_part.added   (first text)
    response.output_text.delta ...
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete | response.failed

``incomplete`` is a response cut at ``max_output_tokens``
(``incomplete_details.reason`` ``max_output_tokens``) or cancelled
(``cancelled``, an extension: ``response.cancel``, a closed socket).
"""

from __future__ import annotations

import time
from typing import Any, Final, Literal

import orjson

from .api_errors import error_object
from .protocol import Done
from .responses_api import Message, ResponsesRequest

__all__ = ["ResponseRender", "Status", "sse", "usage_of"]

Status = Literal["in_progress", "completed", "incomplete", "failed"]

_TERMINAL: Final[dict[str, str]] = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def sse(event: dict[str, Any]) -> bytes:
    """One event as Server-Sent Events: its ``event:`` name, its JSON."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def usage_of(done: Done) -> dict[str, Any]:
    prompt, completion = done.usage.prompt_tokens, done.usage.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": done.usage.cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class ResponseRender:
    """The events and the object of one response."""

    def __init__(
        self,
        request: ResponsesRequest,
        *,
        response_id: str,
        model: str,
        created_at: int | None = None,
    ) -> None:
        self.request = request
        self.id = response_id
        self.model = model
        self.created_at = int(time.time()) if created_at is None else created_at
        self.status: Status = "in_progress"
        self.text_parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_reason: str | None = None
        self._item_id = "msg_" + response_id.removeprefix("resp_")
        self._seq = 0
        self._begun = False
        self._item_open = False
        self._item_done = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def finished(self) -> bool:
        return self.status != "in_progress"

    # ------------------------------------------------------------ events

    def begin(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress`` (once)."""
        if self._begun:
            return []
        self._begun = True
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def delta(self, text: str) -> list[dict[str, Any]]:
        """One text delta (the message item and its part open before the first)."""
        events = self.begin() + self._open_item()
        self.text_parts.append(text)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self._item_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def end(self, done: Done) -> list[dict[str, Any]]:
        """The engine's end: the item closed, then the terminal event."""
        self.usage = usage_of(done)
        if done.reason == "error":
            return self.fail(done.error_code or "internal", done.error_message or "failed")
        if done.reason == "cancelled":
            self.incomplete_reason = "cancelled"
        elif done.reason == "length":
            self.incomplete_reason = "max_output_tokens"
        events = self.begin()
        if done.reason != "cancelled" or self._item_open:
            events += self._open_item() + self._close_item()
        self.status = "completed" if self.incomplete_reason is None else "incomplete"
        return [*events, self._terminal()]

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        """``response.failed`` (after ``created``, so that a client sees one response)."""
        self.error = {"code": code, "message": message}
        events = self.begin()
        self.status = "failed"
        return [*events, self._terminal()]

    def error_event(
        self, status: int, code: str, message: str, param: str | None = None
    ) -> dict[str, Any]:
        """An ``error`` event: a refusal of a request that will not run (HTTP SSE shape)."""
        return self._event("error", code=code, message=message, param=param)

    def _open_item(self) -> list[dict[str, Any]]:
        if self._item_open:
            return []
        self._item_open = True
        return [
            self._event("response.output_item.added", output_index=0, item=self._item()),
            self._event(
                "response.content_part.added",
                item_id=self._item_id,
                output_index=0,
                content_index=0,
                part=_part(""),
            ),
        ]

    def _close_item(self) -> list[dict[str, Any]]:
        self._item_done = True
        text = self.text
        return [
            self._event(
                "response.output_text.done",
                item_id=self._item_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=self._item_id,
                output_index=0,
                content_index=0,
                part=_part(text),
            ),
            self._event("response.output_item.done", output_index=0, item=self._item()),
        ]

    def _terminal(self) -> dict[str, Any]:
        return self._event(_TERMINAL[self.status], response=self.response())

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        if self.request.stream_id is not None:
            event["stream_id"] = self.request.stream_id
        return event

    # ------------------------------------------------------------ the object

    def _item(self) -> dict[str, Any]:
        if not self._item_done:
            status = "in_progress"
        else:
            status = "completed" if self.incomplete_reason is None else "incomplete"
        content = [_part(self.text)] if self._item_done else []
        return {
            "id": self._item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(self) -> dict[str, Any]:
        """The ``response`` object as it stands."""
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": (
                None if self.incomplete_reason is None else {"reason": self.incomplete_reason}
            ),
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None,
            "metadata": dict(request.metadata),
            "model": self.model,
            "output": [self._item()] if self._item_done else [],
            "parallel_tool_calls": True,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": request.store,
            "temperature": request.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_logprobs": 0,
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "user": None,
        }

    def conversation(self, history: tuple[Message, ...]) -> tuple[Message, ...]:
        """What a next turn's ``previous_response_id`` continues: the earlier
        conversation, this input and this output (instructions are not carried
        over, as OpenAI's are not)."""
        answer: Message = {"role": "assistant", "content": self.text}
        return (*history, *self.request.input, answer)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def error_payload(status: int, code: str, message: str, param: str | None) -> dict[str, Any]:
    """The ``error`` member of a WebSocket-mode ``error`` event."""
    return error_object(status, message, code, param)

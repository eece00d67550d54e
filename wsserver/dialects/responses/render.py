"""One response of the Responses API, rendered (sans-I/O).

A :class:`ResponseRender` turns what the request driver gives back — the
start, each ``delta``'s reasoning, text and tool-call parts, the ``done`` —
into the Responses API's typed events, numbered by ``sequence_number`` from
0, and into the ``response`` object itself (the whole body without
``stream``, ``GET /v1/responses/{id}``). The same events go out as SSE
(:func:`sse`) over HTTP and as JSON text messages in WebSocket mode (each
with the ``stream_id`` of its lane, if any).

A response's ``output`` is a list of items, each opened when its first piece
arrives and closed when a piece of another item does (or at the end), at
increasing ``output_index``:

* ``reasoning`` (``rs_…``) — the model's think block (the core's
  :class:`~wsserver.shaping.reasoning.ReasoningSplitter`), its text as one
  ``reasoning_text`` content part; ``summary`` stays empty (we write none);
* ``message`` (``msg_…``) — the answer, one ``output_text`` part;
* ``function_call`` (``fc_…``) — one per call the core parsed
  (:mod:`wsserver.shaping.tool_calls`): ``call_id``, ``name``, ``arguments``.

The order of a response's events::

    response.created, response.in_progress          (once the engine is ours)
    per item:
      response.output_item.added
      reasoning: response.content_part.added, response.reasoning_text.delta ...,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      call:      response.function_call_arguments.delta ...,
                 response.function_call_arguments.done
      response.output_item.done
    response.completed | response.incomplete | response.failed

A response with no item at all (and not cancelled) has one empty message.
``incomplete`` is a response cut at ``max_output_tokens``
(``incomplete_details.reason`` ``max_output_tokens``) or cancelled
(``cancelled``, an extension: ``response.cancel``, a closed socket); the item
open at that moment ends ``incomplete``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from ...core.protocol import Delta, Done
from ...shaping.tool_calls import CallPart, new_call_id
from ..api_errors import error_body
from ..exchange import Failure, Renderer, sse, sse_events
from .api import Message, ResponsesRequest, refusal_wording

__all__ = ["Keep", "ResponseAnswer", "ResponseRender", "Status", "sse", "usage_of"]

#: Keeps a finished response for ``previous_response_id``: (the response
#: object, the conversation up to its output).
Keep = Callable[[dict[str, Any], tuple[Message, ...]], None]

Status = Literal["in_progress", "completed", "incomplete", "failed"]
ItemKind = Literal["reasoning", "message", "function_call"]
_PREFIX: Final[dict[str, str]] = {"reasoning": "rs", "message": "msg", "function_call": "fc"}

#: Where a step appends the events that tell it (None: it makes none).
_Events = list[dict[str, Any]] | None
_Calls = Sequence[CallPart]

_TERMINAL: Final[dict[str, str]] = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def usage_of(done: Done) -> dict[str, Any]:
    prompt, completion = done.usage.prompt_tokens, done.usage.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": done.usage.cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": done.usage.reasoning_tokens},
        "total_tokens": prompt + completion,
    }


@dataclass(slots=True)
class _Item:
    """One output item as it grows."""

    kind: ItemKind
    id: str
    index: int
    texts: list[str] = field(default_factory=list)
    #: A call's parts: its position among the calls, id and name.
    call_index: int | None = None
    call_id: str | None = None
    name: str | None = None
    status: str = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def wire(self) -> dict[str, Any]:
        """The item as ``output`` lists it (and ``output_item`` events carry it)."""
        done = self.status != "in_progress"
        if self.kind == "message":
            return {
                "id": self.id,
                "type": "message",
                "status": self.status,
                "role": "assistant",
                "content": [_part(self.text)] if done else [],
            }
        if self.kind == "reasoning":
            return {
                "id": self.id,
                "type": "reasoning",
                "status": self.status,
                "summary": [],
                "content": [_reasoning_part(self.text)] if done else [],
            }
        return {
            "id": self.id,
            "type": "function_call",
            "status": self.status,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text if done else "",
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
        self.items: list[_Item] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_reason: str | None = None
        self._suffix = response_id.removeprefix("resp_")
        self._seq = 0
        self._begun = False
        self._open: _Item | None = None

    @property
    def text(self) -> str:
        """The answer's text (every message item's)."""
        return "".join(item.text for item in self.items if item.kind == "message")

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

    def delta(
        self, text: str, reasoning: str | None = None, tool_calls: Sequence[CallPart] = ()
    ) -> list[dict[str, Any]]:
        """One delta of the driver: its reasoning, then its text, then its call
        parts, each into its item (opened, and the one before closed, as needed)."""
        events = self.begin()
        self._take(text, reasoning, tool_calls, events)
        return events

    def gather(
        self, text: str, reasoning: str | None = None, tool_calls: Sequence[CallPart] = ()
    ) -> None:
        """One delta for the ``response`` object alone (a whole body): its items
        grow as with :meth:`delta`, and no event is made."""
        self._take(text, reasoning, tool_calls, None)

    def end(self, done: Done) -> list[dict[str, Any]]:
        """The engine's end: the open item closed, then the terminal event
        (``response.failed`` after ``created``, so that a client sees one response)."""
        events: list[dict[str, Any]] = []
        self._end(done, events)
        return events

    def finish(self, done: Done) -> None:
        """The engine's end for the ``response`` object alone (a whole body)."""
        self._end(done, None)

    def error_event(
        self, status: int, code: str, message: str, param: str | None = None
    ) -> dict[str, Any]:
        """An ``error`` event: a refusal of a request that will not run (HTTP SSE shape)."""
        return self._event("error", code=code, message=message, param=param)

    # ------------------------------------------------------------ the items
    #
    # Each step changes the items, then — given a list (``events``), for a
    # stream — appends the events that tell it; given None (a whole body),
    # no event is made at all.

    def _take(self, text: str, reasoning: str | None, calls: _Calls, events: _Events) -> None:
        if reasoning:
            self._add("reasoning", reasoning, None, events)
        if text:
            self._add("message", text, None, events)
        for part in calls:
            self._add("function_call", part.arguments, part, events)

    def _end(self, done: Done, events: _Events) -> None:
        self.usage = usage_of(done)
        if done.reason == "error":
            self.error = {
                "code": done.error_code or "internal",
                "message": done.error_message or "failed",
            }
        elif done.reason == "cancelled":
            self.incomplete_reason = "cancelled"
        elif done.reason == "length":
            self.incomplete_reason = "max_output_tokens"
        if events is not None:
            events += self.begin()
        if self.error is not None:
            self.status = "failed"  # the open item stays out of ``output``
        else:
            if not self.items and done.reason != "cancelled":
                self._open_item("message", None, events)
            self._close(True, events)
            self.status = "completed" if self.incomplete_reason is None else "incomplete"
        if events is not None:
            events.append(self._terminal())

    def _add(self, kind: ItemKind, text: str, part: CallPart | None, events: _Events) -> None:
        item = self._open
        new_call = part is not None and part.name is not None
        if item is None or item.kind != kind or new_call:
            self._close(False, events)
            item = self._open_item(kind, part, events)
        if not text:
            return
        item.texts.append(text)
        if events is None:
            return
        where = {"item_id": item.id, "output_index": item.index}
        if kind == "message":
            events.append(
                self._event(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        elif kind == "reasoning":
            events.append(
                self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
            )
        else:
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=text)
            )

    def _open_item(self, kind: ItemKind, part: CallPart | None, events: _Events) -> _Item:
        index = len(self.items)
        prefix = _PREFIX[kind]
        item = _Item(kind, f"{prefix}_{self._suffix}" + (f"_{index}" if index else ""), index)
        if part is not None:
            item.call_index = part.index
            item.call_id = part.id or new_call_id()
            item.name = part.name
        self.items.append(item)
        self._open = item
        if events is None:
            return item
        events.append(
            self._event("response.output_item.added", output_index=index, item=item.wire())
        )
        if kind != "function_call":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=_part("") if kind == "message" else _reasoning_part(""),
                )
            )
        return item

    def _close(self, final: bool, events: _Events) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        cut = final and self.incomplete_reason is not None
        item.status = "incomplete" if cut else "completed"
        if events is None:
            return
        text = item.text
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            events.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
        elif item.kind == "reasoning":
            events.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        else:
            events.append(
                self._event("response.function_call_arguments.done", **where, arguments=text)
            )
        if item.kind != "function_call":
            part = _part(text) if item.kind == "message" else _reasoning_part(text)
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        events.append(
            self._event("response.output_item.done", output_index=item.index, item=item.wire())
        )

    def _terminal(self) -> dict[str, Any]:
        return self._event(_TERMINAL[self.status], response=self.response())

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        if self.request.stream_id is not None:
            event["stream_id"] = self.request.stream_id
        return event

    # ------------------------------------------------------------ the object

    def response(self) -> dict[str, Any]:
        """The ``response`` object as it stands (``output``: the closed items)."""
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
            "output": [item.wire() for item in self.items if item.status != "in_progress"],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": request.store,
            "temperature": request.temperature,
            "text": {"format": dict(request.text_format)},
            "tool_choice": "auto" if request.tool_choice is None else request.tool_choice,
            "tools": [dict(tool) for tool in request.tools],
            "top_logprobs": 0,
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "user": None,
        }

    def conversation(self, history: tuple[Message, ...]) -> tuple[Message, ...]:
        """What a next turn's ``previous_response_id`` continues: the earlier
        conversation, this input and this output as one assistant message —
        its text and its whole calls, and with calls its reasoning (the next
        turn's ``function_call_output`` items continue this tool-use loop,
        whose reasoning chat templates show, as OpenAI keeps it; an answer
        without calls ends the turn, and templates drop an ended turn's
        reasoning, so it is not kept). Instructions are not carried over, as
        OpenAI's are not; nor is a call cut short by a cancel, whose arguments
        may not be JSON yet."""
        calls = [
            {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.text},
            }
            for item in self.items
            if item.kind == "function_call" and item.status == "completed"
        ]
        answer: dict[str, Any] = {"role": "assistant", "content": self.text}
        if calls:
            answer["tool_calls"] = calls
            if not answer["content"]:
                answer["content"] = None
            reasoning = "".join(item.text for item in self.items if item.kind == "reasoning")
            if reasoning:
                answer["reasoning"] = reasoning
        return (*history, *self.request.input, answer)


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


class ResponseAnswer(Renderer):
    """One ``POST /v1/responses`` answered on the HTTP exchange: the events as
    SSE, or the ``response`` object as the body. In a stream a failed or
    cancelled response ends with its own terminal event (``response.failed``,
    ``response.incomplete``); a refusal before it ran, with an ``error`` event.
    A response that completed (or was cut short) is kept for
    ``previous_response_id`` *before* its last event goes out, so that a
    client may chain on it at once."""

    def __init__(
        self,
        render: ResponseRender,
        *,
        history: tuple[Message, ...] = (),
        keep: Keep | None = None,
    ) -> None:
        self.render = render
        self.stream = render.request.stream
        self._history = history
        self._keep = keep

    def refusal_wording(self, message: str) -> str:
        return refusal_wording(message)

    def started(self) -> bytes:
        return sse_events(self.render.begin())

    def chunk(self, delta: Delta) -> bytes:
        return sse_events(self.render.delta(delta.text, delta.reasoning, delta.tool_calls or ()))

    def last(self, done: Done) -> bytes:
        return self._ended(self.render.end(done))

    def error_event(self, failure: Failure) -> bytes:
        if failure.done is not None:
            return self._ended(self.render.end(failure.done))
        return sse(self.render.error_event(failure.status, failure.code, failure.message))

    def gather(self, delta: Delta) -> None:
        self.render.gather(delta.text, delta.reasoning, delta.tool_calls or ())

    def body(self, done: Done) -> bytes:
        self.render.finish(done)
        self._kept()
        return orjson.dumps(self.render.response())

    def error_body(self, failure: Failure) -> tuple[int, bytes]:
        return failure.status, error_body(failure.status, failure.message, failure.code)

    def _ended(self, events: list[dict[str, Any]]) -> bytes:
        self._kept()
        return sse_events(events)

    def _kept(self) -> None:
        render = self.render
        if self._keep is not None and render.status in ("completed", "incomplete"):
            self._keep(render.response(), render.conversation(self._history))

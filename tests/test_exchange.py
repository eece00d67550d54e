"""The HTTP exchange's half without I/O: how every HTTP dialect's answer ends.

One table (:data:`wsserver.exchange.ENDINGS`) decides, for every dialect,
where the end of an answer goes; each dialect's renderer writes its bytes.
Every renderer answers every cell of the table — those that cannot happen
too — and a whole body gathers, without making events, what a stream tells.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from wsserver.anthropic_api import parse_body as anthropic_body
from wsserver.anthropic_render import MessageAnswer, MessageRender
from wsserver.errors import CONTEXT_LENGTH_EXCEEDED
from wsserver.exchange import ENDINGS, Renderer, ending
from wsserver.openai_api import parse_request
from wsserver.openai_render import CompletionAnswer
from wsserver.protocol import CallPart, Delta, Done, Error, Limits, Timings, Usage
from wsserver.responses_api import parse_body as responses_body
from wsserver.responses_render import ResponseAnswer, ResponseRender

# ---------------------------------------------------------------- the table, sans-I/O


def _renderers(stream: bool) -> list[Renderer]:
    limits = Limits(
        max_frame_bytes=1 << 20,
        max_prompt_chars=1 << 20,
        max_messages=100,
        max_tokens=100,
        default_max_tokens=10,
    )
    chat = parse_request(
        "chat",
        json.dumps({"messages": [{"role": "user", "content": "a"}], "stream": stream}).encode(),
        "r1",
        limits,
    )
    responses = ResponseRender(
        responses_body({"input": "a", "stream": stream}),
        response_id="resp_1",
        model="m",
        created_at=0,
    )
    message = MessageRender(
        anthropic_body(
            {"messages": [{"role": "user", "content": "a"}], "max_tokens": 5, "stream": stream}
        ),
        message_id="msg_1",
        model="m",
    )
    return [CompletionAnswer(chat, "m"), ResponseAnswer(responses), MessageAnswer(message)]


def _done(reason: str) -> Done:
    extra: dict[str, Any] = {}
    if reason == "error":
        extra = {"error_code": "internal", "error_message": "failed"}
    timings = Timings(queued_ms=0.0, ttft_ms=1.0, total_ms=2.0, tokens_per_s=1.0)
    return Done(id="r1", reason=reason, usage=Usage(3, 2), timings=timings, **extra)  # type: ignore[arg-type]


_FRAMES: dict[str, Callable[[], Done | Error]] = {
    "finished": lambda: _done("stop"),
    "cancelled": lambda: _done("cancelled"),
    "error": lambda: _done("error"),
    "context_length_exceeded": lambda: Error(
        id="r1", code="too_large", message="too long", detail=CONTEXT_LENGTH_EXCEEDED
    ),
}


@pytest.mark.parametrize(("terminal", "stream", "head_sent"), sorted(ENDINGS))
def test_every_renderer_answers_every_cell_of_the_table(
    terminal: str, stream: bool, head_sent: bool
) -> None:
    placement, status = ENDINGS[terminal, stream, head_sent]  # type: ignore[index]
    for renderer in _renderers(stream):
        if not stream:
            renderer.gather(Delta(id="r1", seq=0, text="hi"))
        else:
            renderer.chunk(Delta(id="r1", seq=0, text="hi"))
        end = ending(renderer, _FRAMES[terminal](), head_sent=head_sent)
        assert end.in_stream == (placement in ("last", "error_in_band"))
        assert end.data
        if placement in ("last", "body"):
            assert end.status == 200
        elif status is not None and not isinstance(renderer, MessageAnswer):
            assert end.status == status


_DELTAS = [
    Delta(id="r1", seq=0, text="", reasoning="let me think"),
    Delta(id="r1", seq=1, text="the answer"),
    Delta(id="r1", seq=2, text=" is", reasoning=None),
    Delta(
        id="r1",
        seq=3,
        text="",
        tool_calls=(CallPart(0, '{"city": ', "call_a", "weather"), CallPart(0, '"Paris"}')),
    ),
]


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls", "cancelled", "error"])
def test_a_whole_answer_gathers_what_the_stream_tells(reason: str) -> None:
    """A whole body's deltas make no event, and give the object the stream's
    events end with: the same items or blocks, status and usage."""
    streamed, whole = _renderers(True), _renderers(False)
    done = _done(reason)
    for delta in _DELTAS:
        for renderer in streamed:
            renderer.chunk(delta)
        for renderer in whole:
            renderer.gather(delta)
    responses = [r for r in (*streamed, *whole) if isinstance(r, ResponseAnswer)]
    messages = [r for r in (*streamed, *whole) if isinstance(r, MessageAnswer)]
    responses[0].render.end(done)
    responses[1].render.finish(done)
    assert responses[0].render.response() == responses[1].render.response()
    if reason not in ("cancelled", "error"):  # (an Anthropic message that failed has no object)
        messages[0].render.end(done)
        messages[1].render.finish(done)
        assert messages[0].render.message() == messages[1].render.message()

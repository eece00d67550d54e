"""The HTTP exchange: how every HTTP dialect's answer ends, one table for all.

The wire test runs each terminal outcome — stop, length, cancelled (the
server's shutdown), error, context_length_exceeded — streamed and whole,
with the stream's head sent or not, over every HTTP dialect (OpenAI chat
completions and completions, the Responses API, Anthropic's Messages API,
Ollama's chat) on
a real server and raw HTTP, and checks the status, the body's shape and that
the answer ends exactly once. The fake engine below makes each outcome happen
deterministically, by the request's text. A cell that cannot happen says why
in the parametrisation; the sans-I/O test shows the table answers it anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from conftest import FAKE_MODEL, make_config, timeout, wire
from websockets.asyncio.client import connect as ws_connect

from wsserver.aio import Server
from wsserver.backends.base import GenerationRequest, Outcome, TokenSink
from wsserver.backends.fake import FakeBackend
from wsserver.core.protocol import CallPart, Delta, Done, Error, Generate, Limits, Timings, Usage
from wsserver.dialects.anthropic.api import parse_body as anthropic_body
from wsserver.dialects.anthropic.render import MessageAnswer, MessageRender
from wsserver.dialects.exchange import ENDINGS, Renderer, ending
from wsserver.dialects.ollama.render import OllamaAnswer
from wsserver.dialects.openai.api import parse_request
from wsserver.dialects.openai.render import CompletionAnswer
from wsserver.dialects.responses.api import parse_body as responses_body
from wsserver.dialects.responses.render import ResponseAnswer, ResponseRender
from wsserver.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    BackendError,
    GenerationCancelled,
    ProtocolError,
)

# ---------------------------------------------------------------- the engine


def _text(request: GenerationRequest | Generate) -> str:
    if request.prompt is not None:
        return request.prompt
    return request.messages[-1].content if request.messages else ""


class Outcomes(FakeBackend):
    """The fake engine, ending each request as its text says:

    * ``stop`` — a short answer that ends by itself;
    * ``fail`` — a token, then the engine fails (``internal``);
    * ``hang`` — waits for a cancel (``generating`` is set once it waits);
    * ``refuse`` — refused before it runs (``unsupported_option``);
    * ``too long`` — a prompt beyond the context, refused before it runs;
    * ``hold`` — its check waits (off the loop) for ``release``
      (``checking`` is set once it waits);
    * anything else — the fake's words up to ``max_tokens`` (``length``).
    """

    def __init__(self) -> None:
        super().__init__(tokens_per_s=0.0)
        self.checking = threading.Event()
        self.release = threading.Event()
        self.generating = threading.Event()

    def check_blocks(self, frame: Generate) -> bool:
        return _text(frame) == "hold" or super().check_blocks(frame)

    def check(self, frame: Generate) -> None:
        super().check(frame)
        text = _text(frame)
        if text == "too long":
            raise ProtocolError(
                "too_large",
                "the prompt is 900 tokens; the context holds 64 tokens for prompt and completion",
                frame.id,
                detail=CONTEXT_LENGTH_EXCEEDED,
            )
        if text == "refuse":
            raise ProtocolError("unsupported_option", "this engine cannot do that", frame.id)
        if text == "hold":
            self.checking.set()
            assert self.release.wait(timeout(30)), "the test never released the check"

    def generate(
        self,
        request: GenerationRequest,
        *,
        slot: int,
        sink: TokenSink,
        cancel: threading.Event,
    ) -> Outcome:
        text = _text(request)
        if text == "stop":
            sink.prompt_processed(3)
            for word in ("a", " short", " answer."):
                sink.emit(word, 1)
            return Outcome("stop", 3, 3)
        if text == "fail":
            sink.prompt_processed(3)
            sink.emit("half", 1)
            raise BackendError("the engine failed mid-answer")
        if text == "hang":
            sink.prompt_processed(3)
            self.generating.set()
            if cancel.wait(timeout(30)):
                raise GenerationCancelled(request.id)
            raise AssertionError("the test never cancelled the request")
        return super().generate(request, slot=slot, sink=sink, cancel=cancel)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[Server, Outcomes]]:
    backend = Outcomes()
    server = Server(make_config(), backend=backend)
    await server.start()
    try:
        await server.wait_ready()
        yield server, backend
    finally:
        backend.release.set()
        await server.stop(grace=0)


# ---------------------------------------------------------------- the dialects


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str
    #: The body for a request with this text (``stream``: SSE).
    body: Callable[[str, bool], dict[str, Any]]
    #: Whether an SSE event (its name, its data) ends the stream.
    terminal: Callable[[str | None, Any], bool]


def _openai_terminal(name: str | None, data: Any) -> bool:
    return data == "[DONE]" or (isinstance(data, dict) and "error" in data)


DIALECTS = [
    Dialect(
        "openai chat",
        "/v1/chat/completions",
        lambda text, stream: {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 5,
            "stream": stream,
        },
        _openai_terminal,
    ),
    Dialect(
        "openai completions",
        "/v1/completions",
        lambda text, stream: {"prompt": text, "max_tokens": 5, "stream": stream},
        _openai_terminal,
    ),
    Dialect(
        "responses",
        "/v1/responses",
        lambda text, stream: {"input": text, "max_output_tokens": 5, "stream": stream},
        lambda name, data: (
            name in ("response.completed", "response.incomplete", "response.failed", "error")
        ),
    ),
    Dialect(
        "anthropic",
        "/v1/messages",
        lambda text, stream: {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 5,
            "stream": stream,
        },
        lambda name, data: name in ("message_stop", "error"),
    ),
    Dialect(
        "ollama",
        "/api/chat",
        lambda text, stream: {
            "model": FAKE_MODEL,
            "messages": [{"role": "user", "content": text}],
            "options": {"num_predict": 5},
            "stream": stream,
        },
        lambda name, data: data.get("done") is True or "error" in data,
    ),
]


def ndjson_objects(raw: bytes) -> list[tuple[str | None, Any]]:
    """Each object of an NDJSON body (Ollama's stream), as an unnamed event."""
    return [(None, json.loads(line)) for line in raw.decode().splitlines()]


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """Each event of an SSE body: its ``event:`` name (if any) and its data
    (JSON, or the text ``[DONE]``); comments (keep-alives) skipped."""
    events = []
    for block in raw.decode().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                text = line[len("data: ") :]
                data = text if text == "[DONE]" else json.loads(text)
        if data is not None:
            events.append((name, data))
    return events


# ---------------------------------------------------------------- what each dialect answers

#: How a request that ran to its end says so (stop, length), per dialect.
FINISH = {
    "openai chat": {"stop": "stop", "length": "length"},
    "openai completions": {"stop": "stop", "length": "length"},
    "responses": {"stop": "completed", "length": "incomplete"},
    "anthropic": {"stop": "end_turn", "length": "max_tokens"},
    "ollama": {"stop": "stop", "length": "length"},
}
#: A failure as the whole answer: (status, code — Anthropic's error type).
WHOLE_ERROR = {
    "openai": {
        "cancelled": (503, "cancelled"),
        "error": (500, "internal"),
        "refused": (400, "unsupported_option"),
        "context_length_exceeded": (400, "context_length_exceeded"),
    },
    "anthropic": {
        "cancelled": (529, "overloaded_error"),
        "error": (500, "api_error"),
        "refused": (400, "invalid_request_error"),
        "context_length_exceeded": (400, "invalid_request_error"),
    },
    # Ollama's error object has a message only: the status says the rest.
    "ollama": {
        "cancelled": (503, None),
        "error": (500, None),
        "refused": (400, None),
        "context_length_exceeded": (400, None),
    },
}


def check_finished(dialect: str, outcome: str, stream: bool, answer: Any) -> None:
    """The answer of a request that ran to its end: the stream's events (its
    one terminal event last) or the whole body."""
    want = FINISH[dialect][outcome]
    if dialect.startswith("openai"):
        if stream:
            chunks = [data for _, data in answer if isinstance(data, dict)]
            assert chunks[-1]["choices"][0]["finish_reason"] == want
            assert answer[-1][1] == "[DONE]"
        else:
            kind = "chat.completion" if dialect == "openai chat" else "text_completion"
            assert answer["object"] == kind and answer["choices"][0]["finish_reason"] == want
    elif dialect == "ollama":
        last = answer[-1][1] if stream else answer
        assert last["done"] is True and last["done_reason"] == want, last
        assert last["eval_count"] == (3 if outcome == "stop" else 5)
        if stream:
            assert [data["done"] for _, data in answer] == [False] * (len(answer) - 1) + [True]
    elif dialect == "responses":
        response = answer[-1][1]["response"] if stream else answer
        assert response["object"] == "response" and response["status"] == want
        if stream:
            assert answer[-1][0] == f"response.{want}"
    else:
        if stream:
            (delta,) = [data for name, data in answer if name == "message_delta"]
            assert delta["delta"]["stop_reason"] == want and answer[-1][0] == "message_stop"
        else:
            assert answer["type"] == "message" and answer["stop_reason"] == want


def check_error_in_stream(dialect: str, outcome: str, events: list[tuple[str | None, Any]]) -> None:
    """The terminal event of a stream that ended in error (its head was out)."""
    name, data = events[-1]
    if dialect.startswith("openai"):
        code = "cancelled" if outcome == "cancelled" else "internal"
        assert data["error"]["code"] == code, data
        assert "[DONE]" not in [d for _, d in events]
    elif dialect == "ollama":
        assert set(data) == {"error"} and isinstance(data["error"], str), events
        assert not [d for _, d in events if d.get("done") is True], events
    elif dialect == "responses":
        # Its stream has a terminal event for these: incomplete (cancelled), failed.
        if outcome == "cancelled":
            assert name == "response.incomplete", events
            assert data["response"]["incomplete_details"] == {"reason": "cancelled"}
        else:
            assert name == "response.failed", events
            assert data["response"]["error"]["code"] == "internal"
    else:
        kind = "overloaded_error" if outcome == "cancelled" else "api_error"
        assert (name, data["error"]["type"]) == ("error", kind), events
        assert "message_stop" not in [n for n, _ in events]


def check_whole_error(dialect: str, kind: str, status: int, body: Any) -> None:
    table = dialect if dialect in ("anthropic", "ollama") else "openai"
    want_status, want_code = WHOLE_ERROR[table][kind]
    assert status == want_status, (status, body)
    if dialect == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
    elif dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == want_code, body
    else:
        assert body["error"]["code"] == want_code, body


# ---------------------------------------------------------------- the cells

OUTCOMES = ["stop", "length", "cancelled", "error", "context_length_exceeded"]
_TEXT = {"stop": "stop", "length": "go on", "context_length_exceeded": "too long"}


def _impossible(outcome: str, stream: bool, head_sent: bool) -> str | None:
    """Why a cell cannot happen (None: it can)."""
    if not stream and head_sent:
        return "a whole answer sends its head with its body, at the end"
    if stream and not head_sent and outcome in ("stop", "length"):
        return "a stream's head goes out when the request starts, before any text"
    if stream and head_sent and outcome == "context_length_exceeded":
        return "the engine refuses a prompt beyond the context before anything is sent"
    return None


CELLS = [
    pytest.param(
        dialect,
        outcome,
        stream,
        head_sent,
        id=f"{dialect.name}-{outcome}-{'streamed' if stream else 'whole'}"
        f"-{'head sent' if head_sent else 'head not sent'}",
        marks=[pytest.mark.skip(reason=f"impossible by construction: {why}")] if why else [],
    )
    for dialect in DIALECTS
    for outcome in OUTCOMES
    for stream in (True, False)
    for head_sent in (True, False)
    for why in [_impossible(outcome, stream, head_sent)]
]


def test_the_cells_are_every_combination() -> None:
    assert len(CELLS) == len(DIALECTS) * len(OUTCOMES) * 2 * 2
    possible = [c for c in CELLS if not c.marks]
    assert len(possible) == len(DIALECTS) * 12


@pytest.mark.parametrize(("dialect", "outcome", "stream", "head_sent"), CELLS)
async def test_every_outcome_ends_every_dialects_answer_once(
    dialect: Dialect, outcome: str, stream: bool, head_sent: bool
) -> None:
    async with serving() as (server, backend), aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{server.port}{dialect.path}"

        def shut_down() -> None:
            """The server's shutdown, as it reaches the request's connection."""
            (http,) = server.api.live.values()
            http.shutdown()

        if outcome == "cancelled" and stream:
            text = "hang" if head_sent else "hold"
        elif outcome == "cancelled":
            text = "hang"
        elif outcome == "error":
            # With the head out, the engine fails mid-answer; before it, a
            # stream can only be refused (the engine's failure comes after
            # the head, which goes out when the request starts).
            text = "fail" if head_sent or not stream else "refuse"
        else:
            text = _TEXT[outcome]
        request = session.post(url, json=dialect.body(text, stream))
        async with asyncio.timeout(timeout(30)):
            if outcome == "cancelled" and stream and head_sent:
                async with request as response:
                    # The head is in (aiohttp returns with it): now the shutdown.
                    assert response.status == 200
                    shut_down()
                    status, raw, headers = response.status, await response.read(), response.headers
            else:
                answer = asyncio.ensure_future(_fetch(request))
                if outcome == "cancelled":
                    event = backend.generating if text == "hang" else backend.checking
                    assert await asyncio.to_thread(event.wait, timeout(30))
                    shut_down()
                    backend.release.set()
                status, raw, headers = await answer

    if stream and head_sent:
        # The stream's head was out: 200 whatever the end, which is in the stream.
        assert status == 200
        if dialect.name == "ollama":
            assert headers["Content-Type"] == "application/x-ndjson"
            events = ndjson_objects(raw)
        else:
            assert headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(raw)
        ends = [e for e in events if dialect.terminal(*e)]
        assert len(ends) == 1 and ends[0] == events[-1], events
        if outcome in ("stop", "length"):
            check_finished(dialect.name, outcome, True, events)
        else:
            check_error_in_stream(dialect.name, outcome, events)
        return
    # A whole answer, or a stream that ended before its head: one JSON body.
    assert headers["Content-Type"] == "application/json", headers
    body = json.loads(raw)
    if outcome in ("stop", "length"):
        assert status == 200
        check_finished(dialect.name, outcome, False, body)
        return
    kind = "refused" if outcome == "error" and stream else outcome
    check_whole_error(dialect.name, kind, status, body)
    if outcome == "cancelled":
        assert headers["Retry-After"] == "1"


async def _fetch(request: Any) -> tuple[int, bytes, Any]:
    async with request as response:
        return response.status, await response.read(), response.headers


@pytest.mark.parametrize(
    "dialect",
    [*DIALECTS, None, "responses-socket"],
    ids=[*(d.name for d in DIALECTS), "websocket", "responses-socket"],
)
async def test_a_request_resolves_its_model_once(dialect: Dialect | str | None) -> None:
    """On its way in, not again in the driver nor in the pipeline: every
    lookup of a model by name goes through ``ModelPool.lookup``."""
    async with serving() as (server, _), aiohttp.ClientSession() as session:
        models = server.models
        looked_up: list[str | None] = []
        lookup = models.lookup

        def counted(name: str | None, request_id: str | None = None) -> Any:
            looked_up.append(name)
            return lookup(name, request_id)

        models.lookup = counted  # type: ignore[method-assign]
        if dialect is None:
            async with wire(server) as client:
                await client.send({"type": "generate", "id": "g", "prompt": "stop"})
                _, frames = await client.done("g")
                assert frames[-1]["reason"] == "stop"
        elif dialect == "responses-socket":
            async with ws_connect(f"ws://127.0.0.1:{server.port}/v1/responses") as ws:
                create = {"type": "response.create", "input": "stop", "model": FAKE_MODEL}
                await ws.send(json.dumps(create))
                while (event := json.loads(await ws.recv()))["type"] != "response.completed":
                    assert event["type"] != "error", event
                assert event["response"]["model"] == FAKE_MODEL
        else:
            assert isinstance(dialect, Dialect)
            url = f"http://127.0.0.1:{server.port}{dialect.path}"
            body = {**dialect.body("stop", False), "model": FAKE_MODEL}
            status, _, _ = await _fetch(session.post(url, json=body))
            assert status == 200
    assert len(looked_up) == 1, looked_up


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
    ollama = OllamaAnswer("chat", "m", stream=stream, logprobs=False)
    return [
        CompletionAnswer(chat, "m"),
        ResponseAnswer(responses),
        MessageAnswer(message),
        ollama,
    ]


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

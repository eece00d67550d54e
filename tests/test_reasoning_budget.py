"""A reasoning budget: ``reasoning_budget_tokens`` on the WebSocket
``generate`` and the OpenAI chat API (llama-server's per-request name),
Anthropic's ``thinking.budget_tokens``. Once the think block holds that many
tokens and is still open, the engine writes the close tag as the sequence's
next tokens instead of sampling, and the model goes on with its answer.

The core's counter (wsserver/reasoning.py) plain; the field on every wire and
upstream; the fake engine over a WebSocket; the real llama.cpp engine on a tiny
GGUF whose template opens the think block (per sequence, in one batch with a
request that has no budget); and the official ``anthropic`` SDK on it.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from conftest import FAKE_MODEL, running_server, wire

from wsserver.backends.base import GenerationRequest
from wsserver.backends.fake import FakeBackend
from wsserver.backends.openai_wire import request_body
from wsserver.core.protocol import Generate, Limits, Message, parse_client_frame
from wsserver.dialects.anthropic.api import parse_body, to_generate
from wsserver.dialects.openai.api import parse_request
from wsserver.errors import ProtocolError
from wsserver.shaping.reasoning import FORCED_CLOSE, ReasoningBudget

CHAT = [{"role": "user", "content": "Think first."}]


# ---------------------------------------------------------------- the counter


def test_the_tokens_inside_an_opened_block_are_counted() -> None:
    budget = ReasoningBudget(2, opened=True)
    assert not budget.exhausted()
    budget.feed("a")
    assert not budget.exhausted()
    budget.feed("")  # a token whose bytes are held back is a token all the same
    assert budget.exhausted() and budget.spent == 2
    for piece in ("</th", "ink>", "\n\n", "answer"):  # the close the engine wrote
        budget.feed(piece)
    # Closed: done for good ("</th" looked like thought until "ink>" came).
    assert not budget.exhausted() and budget.spent == 3


def test_the_tags_are_not_counted_and_an_answer_costs_nothing() -> None:
    budget = ReasoningBudget(1)
    budget.feed("<think>")
    assert budget.spent == 0 and not budget.exhausted()
    budget.feed("hmm")
    assert budget.spent == 1 and budget.exhausted()
    closed = ReasoningBudget(5)
    for piece in ("<think>", "x", "</think>", "y", "z"):
        closed.feed(piece)
    assert closed.spent == 1 and not closed.exhausted()
    # No block at all: the answer is never cut, even at budget 0.
    answer = ReasoningBudget(0)
    answer.feed("Hello")
    assert not answer.exhausted()
    # A block the template opened, budget 0: closed before the first token.
    assert ReasoningBudget(0, opened=True).exhausted()


# ---------------------------------------------------------------- the wires


def generate(**fields: Any) -> Generate:
    frame = parse_client_frame(json.dumps({"type": "generate", "id": "a", **fields}), Limits())
    assert isinstance(frame, Generate)
    return frame


def test_the_field_on_the_websocket_and_openai_wires() -> None:
    assert generate(messages=CHAT, reasoning_budget_tokens=5).reasoning_budget_tokens == 5
    assert generate(messages=CHAT, reasoning_budget_tokens=0).reasoning_budget_tokens == 0
    # -1 is llama-server's "unrestricted": no budget.
    assert generate(messages=CHAT, reasoning_budget_tokens=-1).reasoning_budget_tokens is None
    for bad in (-2, "5", True, 1.5):
        with pytest.raises(ProtocolError, match="'reasoning_budget_tokens' must be") as info:
            generate(messages=CHAT, reasoning_budget_tokens=bad)
        assert info.value.code == "bad_request"
    with pytest.raises(ProtocolError, match="'reasoning_budget_tokens' needs 'messages'"):
        generate(prompt="p", reasoning_budget_tokens=5)
    body = {"messages": CHAT, "reasoning_budget_tokens": 7}
    chat = parse_request("chat", orjson.dumps(body), "c", Limits()).generate
    assert chat.reasoning_budget_tokens == 7
    # llama-server's other name for it.
    body = {"messages": CHAT, "thinking_budget_tokens": 3}
    assert (
        parse_request("chat", orjson.dumps(body), "c", Limits()).generate.reasoning_budget_tokens
        == 3
    )


def test_the_relay_sends_the_budget_as_llama_servers_field() -> None:
    frame = generate(messages=CHAT, reasoning_budget_tokens=9)
    request = GenerationRequest.from_frame(frame, default_max_tokens=10)
    path, data = request_body(request, "up")
    assert path == "/chat/completions"
    assert orjson.loads(data)["reasoning_budget_tokens"] == 9
    plain = GenerationRequest.from_frame(generate(messages=CHAT), default_max_tokens=10)
    assert "reasoning_budget_tokens" not in orjson.loads(request_body(plain, "up")[1])


def test_anthropics_budget_is_the_cores() -> None:
    body = {"messages": CHAT, "max_tokens": 50, "thinking": {"type": "enabled", "budget_tokens": 9}}
    frame = to_generate(parse_body(body), "m", Limits())
    assert frame.reasoning_budget_tokens == 9 and frame.reasoning_format == "auto"
    disabled = {**body, "thinking": {"type": "disabled"}}
    assert to_generate(parse_body(disabled), "m", Limits()).reasoning_budget_tokens is None


class Unbounded(FakeBackend):
    """An engine that cannot end a think block early."""

    honours = frozenset({"tools"})


def test_an_engine_that_cannot_end_a_block_refuses_the_budget_by_name() -> None:
    with pytest.raises(ProtocolError, match="'reasoning_budget_tokens' is not supported") as info:
        Unbounded().check(generate(messages=CHAT, reasoning_budget_tokens=5))
    assert info.value.code == "unsupported_option"


async def test_the_messages_api_names_thinking_budget_tokens_in_that_refusal() -> None:
    import anthropic
    from conftest import make_config
    from test_anthropic_http import sdk

    from wsserver.aio import Server

    server = Server(make_config(), backend=Unbounded())
    await server.start()
    try:
        await server.wait_ready()
        async with sdk(server) as client:
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(
                    model=FAKE_MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    max_tokens=20,
                    thinking={"type": "enabled", "budget_tokens": 5},
                )
        error = info.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error"
        assert "'thinking.budget_tokens' is not supported" in error["message"]
    finally:
        await server.stop(grace=0)


# ---------------------------------------------------------------- the fake engine


async def test_the_fake_closes_its_block_at_the_budget_and_answers(tmp_path: pathlib.Path) -> None:
    thought = "one two three four five six seven eight"
    path = tmp_path / "script.txt"
    path.write_text(f"<think>{thought}</think>\n\nThe answer.", encoding="utf-8")
    options = {"backend__fake__tokens_per_s": 0.0, "backend__fake__text_file": str(path)}
    async with running_server(**options) as server, wire(server) as client:
        got = {}
        for request_id, budget in (("free", None), ("cut", 3)):
            fields: dict[str, Any] = {"messages": CHAT, "max_tokens": 100}
            if budget is not None:
                fields["reasoning_budget_tokens"] = budget
            await client.send({"type": "generate", "id": request_id, **fields})
            text, frames = await client.done(request_id)
            reasoning = "".join(f.get("reasoning") or "" for f in frames if f["type"] == "delta")
            got[request_id] = (reasoning, text, frames[-1]["usage"])
        assert got["free"][:2] == (thought, "The answer.")
        reasoning, text, usage = got["cut"]
        assert text == "The answer."
        assert thought.startswith(reasoning) and len(reasoning) < len(thought)
        # The close the engine wrote counts as completion tokens.
        assert usage["completion_tokens"] > usage["reasoning_tokens"] > 0


# ---------------------------------------------------------------- the llama engine

llama = pytest.mark.llama


@pytest.fixture(scope="module")
def thinking_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    pytest.importorskip("llama_cpp")
    from test_llama_template import THINKING
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(
        tmp_path_factory.mktemp("think") / "thinking.gguf", chat_template=THINKING
    )


@pytest.fixture(scope="module")
def thinking(thinking_gguf: pathlib.Path) -> Iterator[Any]:
    from test_llama_backend import loaded

    with loaded(thinking_gguf, parallel=2) as backend:
        yield backend


def chat_request(request_id: str, **fields: Any) -> GenerationRequest:
    from test_llama_backend import request

    fields.setdefault("max_tokens", 30)
    return request(None, id=request_id, messages=(Message("user", "Think first."),), **fields)


@llama
def test_the_engine_forces_the_close_per_sequence(thinking: Any) -> None:
    from test_llama_backend import Running

    budget = 5
    # One batch: a sequence with a budget beside one without (greedy, same prompt).
    cut = Running(thinking, chat_request("cut", reasoning_budget=budget))
    free = Running(thinking, chat_request("free"))
    (cut_outcome, cut_sink), (free_outcome, free_sink) = cut.wait(), free.wait()
    close = thinking.engine.reasoning_close
    assert close and thinking.request_stats("cut").forced == len(close)
    assert thinking.request_stats("free").forced == 0
    # The tiny model never closes the block itself: unbounded, all 30 tokens are thought.
    assert FORCED_CLOSE not in "".join(free_sink.pieces)
    assert free_outcome.completion_tokens == 30
    # The budgeted one: the same first `budget` tokens, then the close — exactly,
    # though this tokenizer puts a space before a text — then more tokens.
    forced = b"".join(thinking.vocab.piece(token) for token in close).decode()
    assert forced == FORCED_CLOSE
    first = "".join(free_sink.pieces[:budget])
    cut_text = "".join(cut_sink.pieces)
    assert cut_text.startswith(first + forced), cut_text
    assert len(cut_text) > len(first + forced)
    # The forced tokens are output: in the stream and in the count.
    assert cut_outcome.completion_tokens == cut_sink.tokens == 30
    # Budget 0: the block is closed before anything is sampled.
    _, zero = Running(thinking, chat_request("zero", reasoning_budget=0)).wait()
    assert "".join(zero.pieces).startswith(forced)


@llama
async def test_the_anthropic_sdk_gets_a_thinking_block_within_its_budget(
    thinking_gguf: pathlib.Path,
) -> None:
    from conftest import make_config
    from test_anthropic_http import sdk

    from wsserver.backends.llama import LlamaBackend

    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(thinking_gguf),
        backend__llama__n_threads=1,
        backend__llama__parallel=1,
    )
    asked: dict[str, Any] = {
        "model": "thinking",
        "messages": CHAT,
        "max_tokens": 40,
        "extra_body": {"temperature": 0.0, "top_k": 1},
    }
    budget = 6
    async with running_server(config) as server, sdk(server) as client:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        enabled = {"type": "enabled", "budget_tokens": budget}
        whole = await client.messages.create(**asked, thinking=enabled)
        assert [b.type for b in whole.content] == ["thinking", "text"], whole
        thought = whole.content[0].thinking  # type: ignore[union-attr]
        assert whole.content[1].text  # type: ignore[union-attr]
        assert 0 < len(backend.vocab.tokenize_text(thought)) <= budget
        async with client.messages.stream(**asked, thinking=enabled) as stream:
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        # Without a budget (thinking left to the server's default) the same greedy
        # thought goes on: longer than the budget, and the cut one is its start.
        unbounded = await client.messages.create(**asked)
        assert [b.type for b in unbounded.content] == ["thinking"]
        long_thought = unbounded.content[0].thinking  # type: ignore[union-attr]
        assert long_thought.startswith(thought)
        assert len(backend.vocab.tokenize_text(long_thought)) > budget

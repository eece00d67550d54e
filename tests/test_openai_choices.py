"""Several choices for one prompt (``n`` > 1) on the OpenAI API, end to end:
a real server, the official ``openai`` SDK; the fake engine (its text is a
known function of the seed) and the real llama.cpp engine (the tiny GGUF).

What is checked: every index present, one ``finish_reason`` per index,
choices sorted by index, usage counting the prompt once and the completions
summed; ``n`` above the model's ``parallel`` is a 400 naming ``n``; a client
gone cancels every choice; on llama.cpp the prompt is decoded once and
sampled choices differ.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import (
    FAKE_MODEL,
    expected_fake_text,
    make_config,
    producers_joined,
    running_server,
    timeout,
)
from test_openai_http import MESSAGES, requests_ended, sdk, sync_sdk

from wsserver.aio import Server


def streamed_texts(
    chunks: list[Any], kind: str = "completion"
) -> tuple[dict[int, str], dict[int, list[str]]]:
    """Each index's text and the finish reasons it got, from a stream's chunks."""
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            if kind == "chat":
                texts[choice.index] += choice.delta.content or ""
            else:
                texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    return dict(texts), dict(finishes)


# ---------------------------------------------------------------- the fake engine


async def test_completion_choices_whole_and_streamed_each_with_its_seed() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        whole = await client.completions.create(
            model=FAKE_MODEL, prompt="Once upon", max_tokens=12, seed=9, n=3
        )
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert [c.text for c in whole.choices] == [
            expected_fake_text("Once upon", 12, seed=9 + k) for k in range(3)
        ]
        assert [c.finish_reason for c in whole.choices] == ["length"] * 3
        assert whole.usage is not None
        assert whole.usage.completion_tokens == 36
        single = await client.completions.create(
            model=FAKE_MODEL, prompt="Once upon", max_tokens=12, seed=9
        )
        assert single.usage is not None
        assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
        stream = await client.completions.create(
            model=FAKE_MODEL,
            prompt="Once upon",
            max_tokens=12,
            seed=9,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        texts, finishes = streamed_texts(chunks)
        assert texts == {k: c.text for k, c in enumerate(whole.choices)}
        assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 36
        assert all(c.usage is None for c in chunks[:-1])
        assert len({c.text for c in whole.choices}) == 3  # seeds 9, 10, 11


async def test_chat_choices_streamed_name_the_role_once_per_index() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        stream = await client.chat.completions.create(
            model=FAKE_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=10,
            seed=1,
            n=2,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
        roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks if c.choices]
        assert sorted(index for index, role in roles if role == "assistant") == [0, 1]
        texts, finishes = streamed_texts(chunks, "chat")
        assert finishes == {0: ["length"], 1: ["length"]}
        whole = await client.chat.completions.create(
            model=FAKE_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=10,
            seed=1,
            n=2,
        )
        assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]
        assert texts[0] != texts[1]  # seeds 1 and 2


async def test_more_choices_than_the_models_parallel_is_a_400_naming_n() -> None:
    async with (
        running_server(backend__fake__parallel=2) as server,
        sdk(server) as client,
    ):
        with pytest.raises(openai.BadRequestError, match="at most 2 choices") as info:
            await client.completions.create(model=FAKE_MODEL, prompt="x", n=3)
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "n"
        reply = await client.completions.create(model=FAKE_MODEL, prompt="x", n=2, max_tokens=2)
        assert len(reply.choices) == 2


async def test_a_client_gone_cancels_every_choice_and_frees_their_slots() -> None:
    async with running_server(
        backend__fake__tokens_per_s=20.0, backend__fake__parallel=3
    ) as server:
        client = sync_sdk(server)

        def abandon_then_ask() -> int:
            with client.completions.create(
                model=FAKE_MODEL, prompt="x", max_tokens=100_000, n=3, stream=True
            ) as stream:
                for _chunk in stream:
                    break
            # Every slot free again: three choices at once get them.
            reply = client.completions.create(model=FAKE_MODEL, prompt="x", max_tokens=2, n=3)
            return len(reply.choices)

        try:
            count = await asyncio.wait_for(asyncio.to_thread(abandon_then_ask), timeout(30))
        finally:
            client.close()
        assert count == 3
        assert requests_ended(server, "cancelled") == 3
        assert server.producer_threads() == 0


# ---------------------------------------------------------------- the llama.cpp engine


def llama_server_config(tiny_gguf: Path) -> Any:
    return make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__n_ctx=4096,
        backend__llama__parallel=4,
    )


def decoded(server: Server) -> int:
    return int(server.backend.stats()["prompt_tokens_decoded"])  # type: ignore[attr-defined]


@pytest.mark.llama
async def test_llama_choices_with_the_sdk_share_the_prompt(tiny_gguf: Path) -> None:
    pytest.importorskip("llama_cpp")
    prompt = "Several choices for one prompt, decoded once: " * 4
    async with running_server(llama_server_config(tiny_gguf)) as server, sdk(server) as client:
        greedy_one = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0
        )
        assert greedy_one.usage is not None
        prompt_tokens = greedy_one.usage.prompt_tokens
        # Greedy choices are the greedy answer, each of them.
        greedy = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, n=3
        )
        assert [c.text for c in greedy.choices] == [greedy_one.choices[0].text] * 3
        assert greedy.usage is not None
        assert (greedy.usage.prompt_tokens, greedy.usage.completion_tokens) == (prompt_tokens, 36)
        # Sampled choices differ; streamed, each index ends once.
        before = decoded(server)
        stream = await client.completions.create(
            model="tiny",
            prompt="A different prompt " * 8,
            max_tokens=16,
            temperature=1.5,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"top_k": 0},
        )
        chunks = [chunk async for chunk in stream]
        texts, finishes = streamed_texts(chunks)
        assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 3
        assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 48
        # The prompt went through the model once (most of it, at least: a
        # choice that reached the engine a step late decodes its last token).
        assert decoded(server) - before <= usage.prompt_tokens + 2
        chat = await client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=1.5,
            seed=3,
            n=2,
        )
        assert [c.index for c in chat.choices] == [0, 1]
        assert all(c.finish_reason == "length" for c in chat.choices)
        # Seeds 3 and 4: each choice its own answer.
        assert chat.choices[0].message.content != chat.choices[1].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 16


async def test_a_choice_that_fails_ends_the_answer_and_cancels_the_others() -> None:
    """Two slots, one taken: the first choice gets the other, the second
    finds the queue full (no room to wait): the answer is that 503, and the
    first choice is cancelled — no answer with a missing choice."""
    async with (
        running_server(
            backend__fake__tokens_per_s=20.0,
            backend__fake__parallel=2,
            backend__fake__max_waiting=0,
        ) as server,
        sdk(server) as client,
    ):
        first = await client.completions.create(
            model=FAKE_MODEL, prompt="a", max_tokens=1000, stream=True
        )
        await first.__anext__()
        with pytest.raises(openai.InternalServerError, match="already waiting") as info:
            await client.completions.create(model=FAKE_MODEL, prompt="b", max_tokens=1000, n=2)
        assert info.value.status_code == 503
        await first.close()
        await producers_joined()  # the closed stream's request has let its slot go
        # Both slots come free: the first choice was cancelled, not left to run.
        reply = await client.completions.create(model=FAKE_MODEL, prompt="c", max_tokens=2, n=2)
        assert [c.finish_reason for c in reply.choices] == ["length", "length"]
        assert requests_ended(server, "cancelled") == 2

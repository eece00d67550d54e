"""The reasoning split (wsserver/reasoning.py), alone and through every wire.

Sans-I/O first: the output's bytes split at every position, through the text
assembler and the splitter, give exactly the reasoning and the answer; then
the fake engine streams a think block to a WebSocket client (``delta``'s
``reasoning``) and to the official ``openai`` SDK (``reasoning_content``).
"""

from __future__ import annotations

import json

import openai
import pytest
from conftest import FAKE_MODEL, make_config, running_server, timeout, validate_server_frame, wire

from wsserver.core.pacing import Coalescer
from wsserver.core.protocol import (
    Delta,
    Done,
    Limits,
    Timings,
    Usage,
    parse_server_frame,
    serialize,
)
from wsserver.core.textstream import TextAssembler
from wsserver.dialects.openai.api import parse_request
from wsserver.shaping.reasoning import ReasoningSplitter, opens_reasoning

THOUGHT = "<think>\nLet me see: 日本 é 😀 </th</think>\n\n The answer is 42 </think> ok"
REASONING = "\nLet me see: 日本 é 😀 </th"
ANSWER = "The answer is 42 </think> ok"


def split_bytes(data: bytes, cuts: list[int], *, opened: bool = False) -> tuple[str, str, int]:
    assembler = TextAssembler()
    splitter = ReasoningSplitter(opened=opened)
    reasoning, answer, reasoning_tokens = [], [], 0
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    for piece in pieces:
        split = splitter.feed(assembler.feed(piece), 1)
        reasoning.append(split.reasoning)
        answer.append(split.answer)
        reasoning_tokens += split.reasoning_tokens
    for split in (splitter.feed(assembler.flush()), splitter.flush()):
        reasoning.append(split.reasoning)
        answer.append(split.answer)
    return "".join(reasoning), "".join(answer), reasoning_tokens


def test_a_think_block_split_at_every_byte_position() -> None:
    data = THOUGHT.encode()
    for cut in range(1, len(data)):
        assert split_bytes(data, [cut])[:2] == (REASONING, ANSWER), cut
    # Byte by byte: every marker and every character arrives in pieces.
    reasoning, answer, tokens = split_bytes(data, list(range(1, len(data))))
    assert (reasoning, answer) == (REASONING, ANSWER)
    close = data.index(b"</think>\n\n The") + len("</think>")
    assert tokens == close  # every byte token up to the close was reasoning


def test_a_block_the_template_opened_and_text_without_one() -> None:
    data = "thinking…</think>answer".encode()
    for cut in range(1, len(data)):
        assert split_bytes(data, [cut], opened=True)[:2] == ("thinking…", "answer")
    plain = b"  <thin but no block"
    for cut in range(1, len(plain)):
        assert split_bytes(plain, [cut])[:2] == ("", "  <thin but no block")
    assert split_bytes(b"  <thi", [3])[:2] == ("", "  <thi")  # ended while undecided
    assert split_bytes(b"<think>cut short", [9])[:2] == ("cut short", "")
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<think>\n\n</think>\n\n")


def test_a_delta_carries_reasoning_before_its_text() -> None:
    frame = Delta(id="a", seq=0, text="", reasoning="hmm")
    wire_text = serialize(frame)
    assert json.loads(wire_text) == {
        "type": "delta",
        "id": "a",
        "seq": 0,
        "text": "",
        "reasoning": "hmm",
    }
    validate_server_frame(wire_text.decode())
    assert parse_server_frame(wire_text) == frame
    done = Done("a", "stop", Usage(3, 5, 4), Timings(1.0, 2.0, 3.0, 4.0))
    assert json.loads(serialize(done))["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "reasoning_tokens": 4,
        "cached_tokens": 0,
    }
    assert (
        "reasoning_tokens"
        not in json.loads(serialize(Done("a", "stop", Usage(3, 5), done.timings)))["usage"]
    )


def test_the_coalescer_paces_reasoning_with_the_text() -> None:
    coalescer = Coalescer(flush_window=1.0, flush_tokens=100)
    coalescer.add_reasoning("think", 2)
    assert coalescer.has_text and coalescer.due(0.0)  # the first text goes at once
    assert coalescer.take_reasoning() == ("think", 2)
    assert coalescer.take(0.0) == ("", 2)
    coalescer.add_reasoning("more", 1)
    coalescer.add("answer", 1)
    assert not coalescer.due(0.5)  # the window holds both
    assert coalescer.due(1.5)
    assert coalescer.take_reasoning() == ("more", 1)
    assert coalescer.take(1.5) == ("answer", 2)


def test_reasoning_format_on_the_openai_body() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "reasoning_format": "none"}
    assert (
        parse_request("chat", json.dumps(body).encode(), "r", Limits()).generate.reasoning_format
        == "none"
    )
    with pytest.raises(Exception, match="reasoning_format"):
        parse_request(
            "chat", json.dumps({**body, "reasoning_format": "deepseek"}).encode(), "r", Limits()
        )


def fake_config(**overrides: object) -> object:
    values: dict[str, object] = {"backend__kind": "fake", "backend__fake__tokens_per_s": 0}
    values.update(overrides)
    return make_config(**values)


@pytest.fixture
def thinking_text(tmp_path: object) -> str:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "thought.txt"
    path.write_text(THOUGHT, encoding="utf-8")
    return str(path)


async def test_websocket_deltas_keep_reasoning_apart(thinking_text: str) -> None:
    config = fake_config(backend__fake__text_file=thinking_text)
    async with running_server(config) as server, wire(server) as client:
        chat = [{"role": "user", "content": "q"}]
        await client.send({"type": "generate", "id": "a", "messages": chat})
        _, frames = await client.done("a")
        deltas = [f for f in frames if f["type"] == "delta"]
        assert "".join(f.get("reasoning", "") for f in deltas) == REASONING
        assert "".join(f["text"] for f in deltas) == ANSWER
        assert [f["seq"] for f in deltas] == list(range(len(deltas)))
        usage = frames[-1]["usage"]
        assert 0 < usage["reasoning_tokens"] < usage["completion_tokens"]
        # "none", and a raw prompt: the text as the model wrote it.
        await client.send(
            {"type": "generate", "id": "b", "messages": chat, "reasoning_format": "none"}
        )
        text, frames = await client.done("b")
        assert text == THOUGHT and "reasoning_tokens" not in frames[-1]["usage"]
        await client.send({"type": "generate", "id": "c", "prompt": "q"})
        assert (await client.done("c"))[0] == THOUGHT


async def test_the_server_default_is_configurable(thinking_text: str) -> None:
    config = fake_config(backend__fake__text_file=thinking_text, stream__reasoning_format="none")
    async with running_server(config) as server, wire(server) as client:
        await client.send(
            {"type": "generate", "id": "a", "messages": [{"role": "user", "content": "q"}]}
        )
        assert (await client.done("a"))[0] == THOUGHT


async def test_cancel_mid_reasoning(tmp_path: object) -> None:
    import pathlib

    # A block far longer than the cancel takes to arrive: the answer never comes.
    path = pathlib.Path(str(tmp_path)) / "long.txt"
    path.write_text("<think>" + "hmm " * 20_000 + "</think>answer", encoding="utf-8")
    config = fake_config(backend__fake__text_file=str(path), backend__fake__tokens_per_s=500)
    async with running_server(config) as server, wire(server) as client:
        await client.send(
            {"type": "generate", "id": "a", "messages": [{"role": "user", "content": "q"}]}
        )
        await client.until(lambda f: f["type"] == "delta" and "reasoning" in f)
        await client.send({"type": "cancel", "id": "a"})
        frames = await client.until(lambda f: f["type"] == "done")
        assert frames[-1]["reason"] == "cancelled"
        assert all(f.get("text", "") == "" for f in frames if f["type"] == "delta")


async def test_openai_sdk_gets_reasoning_content(thinking_text: str) -> None:
    config = fake_config(backend__fake__text_file=thinking_text)
    async with running_server(config) as server:
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            messages = [{"role": "user", "content": "q"}]
            reply = await api.chat.completions.create(model=FAKE_MODEL, messages=messages)  # type: ignore[arg-type]
            message = reply.choices[0].message
            assert message.content == ANSWER
            assert getattr(message, "reasoning_content", None) == REASONING
            assert reply.usage is not None and reply.usage.completion_tokens_details is not None
            assert reply.usage.completion_tokens_details.reasoning_tokens
            stream = await api.chat.completions.create(
                model=FAKE_MODEL,
                messages=messages,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
            reasoning, content = [], []
            async for chunk in stream:
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    reasoning.append(getattr(delta, "reasoning_content", None) or "")
                    content.append(delta.content or "")
                elif chunk.usage is not None:
                    details = chunk.usage.completion_tokens_details
                    assert details is not None and details.reasoning_tokens
            assert ("".join(reasoning), "".join(content)) == (REASONING, ANSWER)
        finally:
            await api.close()


async def test_resume_mid_reasoning_keeps_reasoning_apart(tmp_path: object) -> None:
    """A resumable chat loses its connection while its reasoning streams; the
    frames replayed on resume go on where the client was: reasoning stays
    reasoning, the answer stays answer, nothing is lost or sent twice."""
    import asyncio
    import pathlib

    from test_resume import parked

    thought = "".join(f" step{i} 日本 😀" for i in range(300))
    answer = "The answer is 42."
    path = pathlib.Path(str(tmp_path)) / "resume.txt"
    path.write_text(f"<think>{thought}</think>\n{answer}", encoding="utf-8")
    config = fake_config(backend__fake__text_file=str(path), backend__fake__tokens_per_s=400)
    chat = [{"role": "user", "content": "q"}]
    async with running_server(config) as server:
        async with wire(server) as client:
            await client.send(
                {
                    "type": "generate",
                    "id": "r",
                    "messages": chat,
                    "max_tokens": 5000,
                    "resumable": True,
                }
            )
            started = await client.until(lambda f: f["type"] == "started")
            token = started[-1]["resume_token"]
            await client.until(lambda f: f["type"] == "delta" and f["seq"] >= 2)
            before = [f for f in client.frames if f["type"] == "delta"]
            # Mid-reasoning: no answer text has been sent yet.
            assert all(f["text"] == "" for f in before) and before[-1].get("reasoning")
            client.ws.transport.abort()  # a lost connection: no close frame
        await parked(server)
        after_seq = before[-1]["seq"]
        async with wire(server) as client:
            await client.send(
                {"type": "resume", "id": "r", "resume_token": token, "after_seq": after_seq}
            )
            async with asyncio.timeout(timeout(30)):
                await client.until(lambda f: f["type"] == "done" and f["id"] == "r", units=30)
            after = [f for f in client.frames if f.get("id") == "r"]
    assert after[0] == {"type": "resumed", "id": "r", "after_seq": after_seq}
    replayed = [f for f in after if f["type"] == "delta"]
    deltas = before + replayed
    assert [f["seq"] for f in deltas] == list(range(len(deltas)))
    assert "".join(f.get("reasoning", "") for f in deltas) == thought
    assert "".join(f["text"] for f in deltas) == answer
    # No frame mixes them up: every reasoning piece comes before any answer text.
    first_text = next(i for i, f in enumerate(deltas) if f["text"])
    assert not any(f.get("reasoning") for f in deltas[first_text + 1 :])
    done = after[-1]
    assert done["type"] == "done" and done["reason"] == "stop"
    assert 0 < done["usage"]["reasoning_tokens"] < done["usage"]["completion_tokens"]

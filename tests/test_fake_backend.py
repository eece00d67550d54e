"""The fake backend's given-text modes (echo, text_file) over a real server."""

from __future__ import annotations

from pathlib import Path

from conftest import running_server, wire
from hypothesis import given
from hypothesis import strategies as st

from wsserver.backends.fake import text_tokens

MARKDOWN = "# Title\n\nSome **bold** and `code`, 日本語 😀.\n\n```py\nprint(1)\n```\n"


@given(st.text())
def test_text_tokens_join_back_to_the_text(text: str) -> None:
    tokens = text_tokens(text)
    assert b"".join(tokens).decode() == text
    assert all(0 < len(t.decode()) <= 8 for t in tokens)


def test_markdown_syntax_arrives_in_pieces() -> None:
    tokens = [t.decode() for t in text_tokens("**bold** ```py")]
    assert tokens == ["**", "bold", "**", " ```", "py"]


async def test_echo_streams_the_prompt_or_the_last_user_message() -> None:
    async with (
        running_server(backend__fake__echo=True, backend__fake__tokens_per_s=0.0) as server,
        wire(server) as client,
    ):
        await client.send({"type": "generate", "id": "p", "prompt": MARKDOWN})
        text, frames = await client.done("p")
        assert text == MARKDOWN
        assert frames[-1]["reason"] == "stop"
        messages = [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "reply"},
            {"role": "user", "content": "second *one*"},
        ]
        await client.send({"type": "generate", "id": "m", "messages": messages, "max_tokens": 2})
        text, frames = await client.done("m")
        assert text == "second *"
        assert frames[-1]["reason"] == "length"
        assert "stop_sequence" not in frames[-1]
        await client.send({"type": "generate", "id": "s", "prompt": MARKDOWN, "stop": ["zz", "*"]})
        text, frames = await client.done("s")
        assert text == MARKDOWN[: MARKDOWN.index("*")]
        assert frames[-1]["reason"] == "stop" and frames[-1]["stop_sequence"] == "*"


async def test_text_file_is_streamed_to_every_request(tmp_path: Path) -> None:
    path = tmp_path / "answer.md"
    path.write_text(MARKDOWN, encoding="utf-8")
    async with (
        running_server(
            backend__fake__text_file=str(path), backend__fake__tokens_per_s=0.0
        ) as server,
        wire(server) as client,
    ):
        for request_id in ("a", "b"):
            await client.send({"type": "generate", "id": request_id, "prompt": "anything"})
            text, frames = await client.done(request_id)
            assert text == MARKDOWN
            assert frames[-1]["reason"] == "stop"
            assert frames[-1]["usage"]["completion_tokens"] == len(text_tokens(MARKDOWN))

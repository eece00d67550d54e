"""Several choices for one prompt over the WebSocket protocol (``generate``
with ``n``): a real server, a raw client whose every frame is checked
against docs/protocol.schema.json; the fake engine, whose text is a known
function of the seed."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from conftest import expected_fake_text, running_server, wire


def by_choice(frames: list[dict[str, Any]]) -> dict[int, str]:
    texts: dict[int, str] = defaultdict(str)
    for frame in frames:
        if frame["type"] == "delta":
            texts[frame["choice"]] += frame["text"]
    return dict(texts)


async def test_generate_with_n_streams_each_choice_then_one_done() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        async with wire(server) as client:
            await client.send(
                {
                    "type": "generate",
                    "id": "g",
                    "prompt": "Once upon",
                    "max_tokens": 9,
                    "seed": 4,
                    "n": 3,
                }
            )
            _, frames = await client.done("g")
            assert [f["type"] for f in frames].count("started") == 1
            ends = [f for f in frames if f["type"] == "choice_done"]
            assert sorted(f["choice"] for f in ends) == [0, 1, 2]
            assert all(
                f["reason"] == "length" and f["usage"] == {"completion_tokens": 9} for f in ends
            )
            done = frames[-1]
            assert done["type"] == "done" and done["reason"] == "length"
            assert [f["type"] for f in frames].count("done") == 1
            assert done["usage"]["completion_tokens"] == 27
            texts = by_choice(frames)
            assert texts == {k: expected_fake_text("Once upon", 9, seed=4 + k) for k in range(3)}
            # A request without n sees what it always saw: no choice anywhere.
            await client.send(
                {"type": "generate", "id": "one", "prompt": "Once upon", "max_tokens": 5, "seed": 4}
            )
            text, mine = await client.done("one")
            assert text == texts[0][: len(text)] and text
            assert all("choice" not in f for f in mine)
            assert not any(f["type"] == "choice_done" for f in mine)


async def test_cancel_ends_every_choice_with_one_done() -> None:
    async with running_server(
        backend__fake__tokens_per_s=20.0, backend__fake__parallel=2
    ) as server:
        async with wire(server) as client:
            await client.send(
                {"type": "generate", "id": "c", "prompt": "x", "max_tokens": 100_000, "n": 2}
            )
            await client.until(lambda f: f["type"] == "delta")
            await client.send({"type": "cancel", "id": "c"})
            _, frames = await client.done("c")
            dones = [f for f in frames if f["type"] == "done"]
            assert [d["reason"] for d in dones] == ["cancelled"]
            # Both slots are free: two choices again at once.
            await client.send(
                {"type": "generate", "id": "d", "prompt": "x", "max_tokens": 2, "n": 2}
            )
            _, again = await client.done("d")
            assert again[-1]["reason"] == "length"
            assert len([f for f in again if f["type"] == "choice_done"]) == 2


async def test_n_refusals_name_it() -> None:
    async with running_server(backend__fake__parallel=2) as server:
        async with wire(server) as client:
            for frame, message in [
                ({"n": 3}, "at most 2 choices"),
                ({"n": 0}, "'n' must be an integer from 1 to 128"),
                ({"n": 2, "resumable": True}, "'resumable'"),
            ]:
                await client.send({"type": "generate", "id": "r", "prompt": "x", **frame})
                error = await client.until(lambda f: f["type"] == "error")
                assert message in error[-1]["message"], error[-1]
            await client.send(
                {"type": "generate", "id": "ok", "prompt": "x", "max_tokens": 2, "n": 2}
            )
            await client.done("ok")
            await client.send({"type": "restart", "id": "ok", "new_id": "ok2"})
            error = await client.until(lambda f: f["type"] == "error")
            assert "'restart'" in error[-1]["message"]
            await client.send({"type": "generate", "id": "ok", "prompt": "x"})
            error = await client.until(lambda f: f["type"] == "error")
            assert error[-1]["code"] == "duplicate_id"


async def test_the_python_client_gives_each_choices_text() -> None:
    from wsserver_client import Client

    async with (
        running_server(backend__fake__tokens_per_s=0.0) as server,
        Client(server.url, resumable=True) as client,
    ):
        stream = client.generate("hello there", max_tokens=6, seed=5, n=2)
        async for _ in stream:
            pass
        assert stream.done is not None and stream.done.usage.completion_tokens == 12
        assert stream.choice_texts() == [
            expected_fake_text("hello there", 6, seed=5 + k) for k in range(2)
        ]
        assert sorted(end.choice for end in stream.choice_ends) == [0, 1]

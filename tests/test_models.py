"""Several models on one server (wsserver/models.py, wsserver/aio/models.py).

The room planner is tested without I/O; the registry on a real server with
real llama.cpp: two tiny random GGUFs (tests/tiny_gguf.py, different seeds so
their greedy texts differ) and, for memory, the default model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

from wsserver.core.models import Resident, plan_room

# ---------------------------------------------------------------- the planner (sans-I/O)


def test_a_model_that_fits_unloads_nothing() -> None:
    assert plan_room(10, 100, [Resident("a", 50, idle=True, last_used=1.0)]) == []


def test_room_is_made_from_idle_models_least_recently_used_first() -> None:
    resident = [
        Resident("new", 40, idle=True, last_used=3.0),
        Resident("old", 40, idle=True, last_used=1.0),
        Resident("mid", 40, idle=True, last_used=2.0),
    ]
    assert plan_room(30, 130, resident) == ["old"]
    assert plan_room(70, 130, resident) == ["old", "mid"]


def test_a_busy_model_is_never_chosen_and_the_load_waits() -> None:
    resident = [
        Resident("busy", 60, idle=False, last_used=0.0),
        Resident("idle", 30, idle=True, last_used=5.0),
    ]
    assert plan_room(30, 100, resident) == ["idle"]
    # Even with the idle one gone it would not fit beside the busy one: wait.
    assert plan_room(50, 100, resident) is None


def test_a_model_larger_than_the_budget_loads_once_everything_idle_is_gone() -> None:
    resident = [Resident("a", 30, idle=True, last_used=0.0)]
    assert plan_room(500, 100, resident) == ["a"]
    assert plan_room(500, 100, []) == []


# ---------------------------------------------------------------- the registry, with llama.cpp

llama_cpp = pytest.importorskip("llama_cpp")

from conftest import make_config, running_server, slow_wire, timeout, wire  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

from wsserver.aio import Server  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.backends.llama_embed_chunks import PIECE_TOKENS  # noqa: E402

GREEDY = {"prompt": "The capital of France", "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    return {
        "alpha": write_tiny_gguf(folder / "alpha.gguf", seed=1),
        "beta": write_tiny_gguf(folder / "beta.gguf", seed=2, n_embd=128),
    }


def settings(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "backend__kind": "llama",
        "backend__llama__n_threads": 1,
        "backend__llama__n_ctx": 256,
        "backend__llama__parallel": 2,
    }
    values.update(overrides)
    return values


def two_models(ggufs: dict[str, Path], **overrides: Any) -> Any:
    """alpha is the default (backend.llama.model), beta a [[backend.llama.models]] table."""
    return make_config(
        **settings(
            backend__llama__model=str(ggufs["alpha"]),
            backend__llama__models=[{"name": "beta", "model": str(ggufs["beta"])}],
            **overrides,
        )
    )


def estimate(path: Path) -> int:
    return LlamaBackend(model=str(path), n_ctx=256, parallel=2).memory_estimate()


@contextlib.asynccontextmanager
async def serving(config: Any) -> AsyncIterator[Server]:
    async with running_server(config) as server:
        yield server


async def greedy_alone(path: Path) -> str:
    """The model's greedy text on a server that serves it alone."""
    async with serving(make_config(**settings(backend__llama__model=str(path)))) as server:
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "alone", **GREEDY})
            text, frames = await client.done("alone", units=30)
    assert frames[-1]["reason"] in ("stop", "length")
    return text


@pytest.fixture(scope="module")
def alone(ggufs: dict[str, Path]) -> dict[str, str]:
    texts = {name: asyncio.run(greedy_alone(path)) for name, path in ggufs.items()}
    assert texts["alpha"] != texts["beta"], "the two test models must answer differently"
    return texts


async def test_each_model_answers_as_it_does_alone_and_hello_lists_both(
    ggufs: dict[str, Path], alone: dict[str, str]
) -> None:
    async with serving(two_models(ggufs)) as server, wire(server) as client:
        hello = client.hello
        assert hello is not None and hello["model"] == "alpha"
        assert [(m["name"], m["state"]) for m in hello["models"]] == [
            ("alpha", "loaded"),
            ("beta", "unloaded"),
        ]
        assert hello["models"][1]["n_ctx"] == 256 and hello["models"][1]["parallel"] == 2
        # Loaded, a model without a chat template says so; unloaded, nothing is said.
        assert hello["models"][0]["chat_template"] is False
        assert "chat_template" not in hello["models"][1]
        await client.send({"type": "generate", "id": "b1", "model": "beta", **GREEDY})
        text, frames = await client.done("b1", units=60)
        assert frames[0] == {"type": "queued", "id": "b1", "position": 1, "loading": True}
        assert text == alone["beta"]
        assert frames[-1]["model"] == "beta"
        await client.send({"type": "generate", "id": "a1", **GREEDY})
        text, frames = await client.done("a1", units=30)
        assert text == alone["alpha"] and frames[-1]["model"] == "alpha"
        assert "queued" not in [f["type"] for f in frames]
    async with serving(two_models(ggufs)) as server, wire(server) as client:
        # A restart keeps its request's model unless it names another.
        await client.send({"type": "generate", "id": "r1", "model": "beta", **GREEDY})
        await client.done("r1", units=60)
        await client.send({"type": "restart", "id": "r1", "new_id": "r2"})
        text, frames = await client.done("r2", units=30)
        assert text == alone["beta"] and frames[-1]["model"] == "beta"
        await client.send({"type": "restart", "id": "r2", "new_id": "r3", "model": "alpha"})
        text, frames = await client.done("r3", units=30)
        assert text == alone["alpha"] and frames[-1]["model"] == "alpha"


async def test_concurrent_requests_to_two_models_both_complete(
    ggufs: dict[str, Path], alone: dict[str, str]
) -> None:
    async with serving(two_models(ggufs)) as server:
        async with wire(server) as one, wire(server) as two:
            await one.send({"type": "generate", "id": "a", **GREEDY})
            await two.send({"type": "generate", "id": "b", "model": "beta", **GREEDY})
            (text_a, _), (text_b, _) = await asyncio.gather(
                one.done("a", units=60), two.done("b", units=60)
            )
        assert (text_a, text_b) == (alone["alpha"], alone["beta"])
        assert {m.name: m.state for m in server.models.infos()} == {
            "alpha": "loaded",
            "beta": "loaded",
        }


async def test_an_unknown_model_is_refused_before_anything_is_queued(
    ggufs: dict[str, Path],
) -> None:
    async with serving(two_models(ggufs)) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "x", "model": "nope", **GREEDY})
        frame = await client.recv()
        assert frame["type"] == "error" and frame["id"] == "x"
        assert frame["code"] == "model_not_found"
        assert "'nope'" in frame["message"] and "'beta'" in frame["message"]
        await client.send({"type": "generate", "id": "ok", **GREEDY})
        await client.done("ok", units=30)
        await client.send({"type": "restart", "id": "ok", "new_id": "y", "model": "nope"})
        frame = await client.recv()
        assert (frame["type"], frame["id"], frame["code"]) == ("error", "y", "model_not_found")
        assert server.models.models["beta"].state == "unloaded"


async def test_a_budget_for_one_model_unloads_the_idle_one_never_a_busy_one(
    ggufs: dict[str, Path], alone: dict[str, str]
) -> None:
    sizes = estimate(ggufs["alpha"]), estimate(ggufs["beta"])
    config = two_models(
        ggufs, backend__llama__models_memory_bytes=max(sizes) + 1, stream__stall_timeout_s=0.0
    )
    async with serving(config) as server:
        alpha, beta = server.models.models["alpha"], server.models.models["beta"]
        async with slow_wire(server) as stuck, wire(server) as client:
            # A request on alpha that stays running: its client reads nothing.
            await stuck.send(
                {"type": "generate", "id": "long", "prompt": "Hello", "max_tokens": 8000}
            )
            await stuck.until(lambda f: f["type"] == "delta")
            await client.send({"type": "generate", "id": "b", "model": "beta", **GREEDY})
            queued = await client.recv()
            assert queued == {"type": "queued", "id": "b", "position": 1, "loading": True}
            # beta waits for room; alpha runs a request and is not unloaded under it.
            assert alpha.state == "loaded" and alpha.unloads == 0
            assert beta.state == "loading" and beta.loads == 0
            await stuck.send({"type": "cancel", "id": "long"})
            text, frames = await client.done("b", units=60)
            assert text == alone["beta"] and frames[-1]["model"] == "beta"
            assert (alpha.state, alpha.unloads, beta.state) == ("unloaded", 1, "loaded")
            # And back: beta is idle now, so alpha's load unloads it.
            await client.send({"type": "generate", "id": "a", **GREEDY})
            text, _ = await client.done("a", units=60)
            assert text == alone["alpha"]
            assert (alpha.state, beta.state, beta.unloads) == ("loaded", "unloaded", 1)
        metric = server.metrics.registry.get_sample_value
        assert metric("wsserver_model_loaded", {"model": "alpha"}) == 1.0
        assert metric("wsserver_model_loaded", {"model": "beta"}) == 0.0
        assert metric("wsserver_model_unloads_total", {"model": "alpha"}) == 1.0
        assert metric("wsserver_model_loads_total", {"model": "alpha"}) == 2.0
        assert metric("wsserver_model_memory_bytes", {"model": "beta"}) == 0.0
        assert metric("wsserver_model_memory_bytes", {"model": "alpha"}) == sizes[0]


async def test_a_cancel_while_waiting_for_a_load_frees_the_place_at_once(
    ggufs: dict[str, Path],
) -> None:
    sizes = estimate(ggufs["alpha"]), estimate(ggufs["beta"])
    config = two_models(
        ggufs, backend__llama__models_memory_bytes=max(sizes) + 1, stream__stall_timeout_s=0.0
    )
    async with serving(config) as server:
        beta = server.models.models["beta"]
        async with slow_wire(server) as stuck, wire(server) as one, wire(server) as two:
            await stuck.send(
                {"type": "generate", "id": "long", "prompt": "Hello", "max_tokens": 8000}
            )
            await stuck.until(lambda f: f["type"] == "delta")
            await one.send({"type": "generate", "id": "w1", "model": "beta", **GREEDY})
            assert (await one.recv())["position"] == 1
            await two.send({"type": "generate", "id": "w2", "model": "beta", **GREEDY})
            assert (await two.recv()) == {
                "type": "queued",
                "id": "w2",
                "position": 2,
                "loading": True,
            }
            await one.send({"type": "cancel", "id": "w1"})
            done = await one.recv()
            assert (done["type"], done["id"], done["reason"]) == ("done", "w1", "cancelled")
            # The place is freed at once: w2 moves up.
            assert (await two.recv()) == {
                "type": "queued",
                "id": "w2",
                "position": 1,
                "loading": True,
            }
            await two.send({"type": "cancel", "id": "w2"})
            assert (await two.recv())["reason"] == "cancelled"
            # Nobody waits for beta any more: its load is given up.
            async with asyncio.timeout(timeout(10)):
                await server.models.wait_state("beta", "unloaded")
            assert beta.loads == 0 and beta.scheduler.waiting == 0
            await stuck.send({"type": "cancel", "id": "long"})
            # Exactly one terminal frame each: nothing more arrives for w1.
            await one.send({"type": "generate", "id": "after", **GREEDY})
            await one.done("after", units=30)
            terminal = [f for f in one.frames if f.get("id") == "w1" and f["type"] != "queued"]
            assert terminal == [done]


async def test_a_model_that_fails_to_load_fails_only_its_requests(
    ggufs: dict[str, Path], tmp_path: Path, alone: dict[str, str]
) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all" * 100)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(ggufs["beta"].read_bytes()[: ggufs["beta"].stat().st_size // 2])
    config = make_config(
        **settings(
            backend__llama__model=str(ggufs["alpha"]),
            backend__llama__models=[
                {"name": "garbage", "model": str(garbage)},
                {"name": "truncated", "model": str(truncated)},
            ],
        )
    )
    async with serving(config) as server, wire(server) as client:
        for name in ("garbage", "truncated"):
            await client.send({"type": "generate", "id": name, "model": name, **GREEDY})
            frames = await client.until(lambda f: f["type"] in ("error", "done"), units=30)
            assert frames[0]["type"] == "queued" and frames[0]["loading"] is True
            error = frames[-1]
            assert (error["type"], error["id"], error["code"]) == (
                "error",
                name,
                "model_load_failed",
            )
            assert name in error["message"]
            assert server.models.models[name].state == "unloaded"
            failures = {"model": name}
            assert (
                server.metrics.registry.get_sample_value(
                    "wsserver_model_load_failures_total", failures
                )
                == 1.0
            )
        await client.send({"type": "generate", "id": "fine", **GREEDY})
        text, _ = await client.done("fine", units=30)
        assert text == alone["alpha"]


async def test_an_idle_model_is_unloaded_after_its_keep_alive(ggufs: dict[str, Path]) -> None:
    config = make_config(
        **settings(
            backend__llama__model=str(ggufs["alpha"]),
            backend__llama__models=[
                {"name": "beta", "model": str(ggufs["beta"]), "keep_alive_s": 0.2}
            ],
        )
    )
    async with serving(config) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "b", "model": "beta", **GREEDY})
        await client.done("b", units=60)
        async with asyncio.timeout(timeout(10)):
            await server.models.wait_state("beta", "unloaded")
        beta = server.models.models["beta"]
        assert (beta.loads, beta.unloads) == (1, 1)
        # The default model has no keep-alive here: it stays.
        assert server.models.models["alpha"].state == "loaded"
        # A new request loads it again.
        await client.send({"type": "generate", "id": "b2", "model": "beta", **GREEDY})
        _, frames = await client.done("b2", units=60)
        assert frames[0]["loading"] is True and frames[-1]["reason"] in ("stop", "length")


async def test_a_preloaded_model_is_loaded_when_the_server_is_ready(
    ggufs: dict[str, Path],
) -> None:
    config = make_config(
        **settings(
            backend__llama__model=str(ggufs["alpha"]),
            backend__llama__models=[{"name": "beta", "model": str(ggufs["beta"]), "preload": True}],
        )
    )
    async with serving(config) as server, wire(server) as client:
        assert [m["state"] for m in (client.hello or {})["models"]] == ["loaded", "loaded"]
        await client.send({"type": "generate", "id": "b", "model": "beta", **GREEDY})
        _, frames = await client.done("b", units=30)
        assert frames[0]["type"] == "started"


async def test_models_dir_serves_each_gguf_by_its_stem(ggufs: dict[str, Path]) -> None:
    folder = ggufs["alpha"].parent
    config = make_config(**settings(backend__llama__models_dir=str(folder)))
    async with serving(config) as server:
        assert server.models.names() == ["alpha", "beta"]
        assert server.models.default.name == "alpha"


async def test_the_http_apis_choose_the_model_and_refuse_an_unknown_one(
    ggufs: dict[str, Path], alone: dict[str, str]
) -> None:
    import anthropic
    import openai

    async with serving(two_models(ggufs)) as server:
        base = f"http://127.0.0.1:{server.port}"
        client = openai.AsyncOpenAI(
            base_url=base + "/v1", api_key="unused", max_retries=0, timeout=timeout(60)
        )
        claude = anthropic.AsyncAnthropic(
            base_url=base, api_key="unused", max_retries=0, timeout=timeout(60)
        )
        try:
            listed = await client.models.list()
            states = {m.id: m.model_extra["state"] for m in listed.data}  # type: ignore[index]
            assert states == {"alpha": "loaded", "beta": "unloaded"}
            beta = await client.models.retrieve("beta")
            assert beta.model_extra is not None and beta.model_extra["n_ctx"] == 256
            completion = await client.completions.create(
                model="beta", prompt=GREEDY["prompt"], max_tokens=24, temperature=0
            )
            assert completion.model == "beta"
            assert completion.choices[0].text == alone["beta"]
            listed = await client.models.list()
            assert {m.id: m.model_extra["state"] for m in listed.data}["beta"] == "loaded"  # type: ignore[index]
            completion = await client.completions.create(
                model="alpha", prompt=GREEDY["prompt"], max_tokens=24, temperature=0
            )
            assert completion.choices[0].text == alone["alpha"]
            with pytest.raises(openai.NotFoundError) as caught:
                await client.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "hi"}]
                )
            assert caught.value.status_code == 404
            assert caught.value.code == "model_not_found"
            with pytest.raises(openai.NotFoundError) as caught:
                await client.responses.create(model="nope", input="hi")
            assert caught.value.code == "model_not_found"
            response = await client.responses.create(
                model="beta", input="hi", max_output_tokens=16, temperature=0
            )
            assert response.model == "beta"
            with pytest.raises(anthropic.NotFoundError) as refused:
                await claude.messages.create(
                    model="nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                )
            assert refused.value.status_code == 404
            assert "'nope'" in str(refused.value)
            message = await claude.messages.create(
                model="beta", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
            assert message.model == "beta"
        finally:
            await client.close()
            await claude.close()


async def test_one_model_is_strict_too_and_an_alias_serves_a_hard_coded_name(
    ggufs: dict[str, Path],
) -> None:
    """An unknown name is model_not_found on every wire, with one model as with
    several, before anything is queued; an alias (``aliases``) is served, and
    every answer names the model by its own name."""
    import anthropic
    import openai

    config = make_config(
        **settings(backend__llama__model=str(ggufs["alpha"]), backend__llama__aliases=["gpt-4o"])
    )
    async with serving(config) as server:
        base = f"http://127.0.0.1:{server.port}"
        client = openai.AsyncOpenAI(
            base_url=base + "/v1", api_key="unused", max_retries=0, timeout=timeout(60)
        )
        claude = anthropic.AsyncAnthropic(
            base_url=base, api_key="unused", max_retries=0, timeout=timeout(60)
        )
        chat = [{"role": "user", "content": "Hi"}]
        try:
            listed = await client.models.list()
            assert [m.id for m in listed.data] == ["alpha"]
            assert [m.model_extra["aliases"] for m in listed.data] == [["gpt-4o"]]  # type: ignore[index]
            assert (await client.models.retrieve("gpt-4o")).id == "alpha"
            refusals = (
                client.chat.completions.create(model="gpt-5", messages=chat),  # type: ignore[arg-type]
                client.completions.create(model="gpt-5", prompt="Hi"),
                client.responses.create(model="gpt-5", input="Hi"),
            )
            for refused in refusals:
                with pytest.raises(openai.NotFoundError) as caught:
                    await refused
                assert caught.value.code == "model_not_found"
                assert "'gpt-5'" in caught.value.message and "'alpha'" in caught.value.message
            for call in (
                claude.messages.create(model="gpt-5", max_tokens=4, messages=chat),  # type: ignore[arg-type]
                claude.messages.count_tokens(model="gpt-5", messages=chat),  # type: ignore[arg-type]
            ):
                with pytest.raises(anthropic.NotFoundError) as missing:
                    await call
                assert missing.value.status_code == 404 and "'alpha'" in str(missing.value)
            assert server.models.models["alpha"].scheduler.waiting == 0

            completion = await client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=4)
            assert completion.model == "alpha"
            reply = await client.chat.completions.create(
                model="gpt-4o",
                messages=chat,  # type: ignore[arg-type]
                max_tokens=4,
            )
            assert reply.model == "alpha"
            response = await client.responses.create(
                model="gpt-4o", input="Hi", max_output_tokens=4
            )
            assert response.model == "alpha"
            message = await claude.messages.create(model="gpt-4o", max_tokens=4, messages=chat)  # type: ignore[arg-type]
            assert message.model == "alpha"
            counted = await claude.messages.count_tokens(model="gpt-4o", messages=chat)  # type: ignore[arg-type]
            assert counted.input_tokens > 0

            async with client.responses.connect(max_retries=0) as connection:
                await connection.send({"type": "response.create", "model": "gpt-5", "input": "Hi"})
                async with asyncio.timeout(timeout(30)):
                    event = await connection.recv()
                assert event.type == "error" and event.status == 404
                assert "'gpt-5'" in event.error.message
                await connection.send(
                    {
                        "type": "response.create",
                        "model": "gpt-4o",
                        "input": "Hi",
                        "max_output_tokens": 4,
                    }
                )
                async with asyncio.timeout(timeout(30)):
                    async for event in connection:
                        if event.type in ("response.completed", "response.incomplete"):
                            assert event.response.model == "alpha"
                            break
        finally:
            await client.close()
            await claude.close()

        async with wire(server) as ws:
            assert ws.hello is not None
            assert [(m["name"], m["aliases"]) for m in ws.hello["models"]] == [
                ("alpha", ["gpt-4o"])
            ]
            await ws.send({"type": "generate", "id": "x", "model": "gpt-5", "prompt": "Hi"})
            refused_frame = await ws.recv()  # the very next frame: nothing was queued
            assert (refused_frame["type"], refused_frame["id"]) == ("error", "x")
            assert refused_frame["code"] == "model_not_found"
            assert "'alpha'" in refused_frame["message"]
            # The connection keeps working; the alias is served under the model's name.
            await ws.send(
                {"type": "generate", "id": "y", "model": "gpt-4o", "prompt": "Hi", "max_tokens": 4}
            )
            _, frames = await ws.done("y", units=30)
            assert frames[-1]["model"] == "alpha"
            await ws.send({"type": "restart", "id": "y", "new_id": "z", "model": "gpt-5"})
            refused_frame = await ws.recv()
            assert (refused_frame["id"], refused_frame["code"]) == ("z", "model_not_found")
            await ws.send({"type": "restart", "id": "y", "new_id": "w", "model": "gpt-4o"})
            _, frames = await ws.done("w", units=30)
            assert frames[-1]["model"] == "alpha"


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_switching_from_the_default_model_returns_its_memory(
    ggufs: dict[str, Path], alone: dict[str, str]
) -> None:
    """The default model (~250 MB of weights) and a tiny one, a budget that
    fits one: asking for the tiny one unloads the default, and the process's
    memory falls by about the default's weights; asking for the default again
    loads it back, and its greedy text is what it was."""
    from wsserver.backends.llama_memory import default_model_path

    default = default_model_path()
    default_size = LlamaBackend(model=str(default), n_ctx=256, parallel=2).memory_estimate()
    config = make_config(
        **settings(
            backend__llama__model=str(default),
            backend__llama__models=[{"name": "beta", "model": str(ggufs["beta"])}],
            backend__llama__models_memory_bytes=default_size + 1,
        )
    )
    async with serving(config) as server, wire(server) as client:
        name = server.models.default.name
        await client.send({"type": "generate", "id": "d1", **GREEDY})
        first, _ = await client.done("d1", units=120)
        with_default = rss_bytes()
        await client.send({"type": "generate", "id": "b", "model": "beta", **GREEDY})
        text, _ = await client.done("b", units=120)
        assert text == alone["beta"]
        assert server.models.models[name].state == "unloaded"
        freed = with_default - rss_bytes()
        assert freed > default.stat().st_size // 2, f"only {freed >> 20} MB returned"
        await client.send({"type": "generate", "id": "d2", **GREEDY})
        again, frames = await client.done("d2", units=120)
        assert frames[0]["loading"] is True
        assert again == first
        assert server.models.models["beta"].state == "unloaded"


async def test_a_requests_keep_alive_zero_unloads_its_model_once_idle(
    ggufs: dict[str, Path],
) -> None:
    async with serving(two_models(ggufs)) as server, wire(server) as client:
        await client.send(
            {"type": "generate", "id": "b", "model": "beta", "keep_alive": 0, **GREEDY}
        )
        await client.done("b", units=60)
        async with asyncio.timeout(timeout(10)):
            await server.models.wait_state("beta", "unloaded")
        assert server.models.models["beta"].unloads == 1
        await client.send({"type": "generate", "id": "bad", "keep_alive": -2, **GREEDY})
        frame = await client.recv()
        assert frame["code"] == "bad_request" and "'keep_alive'" in frame["message"]


async def test_keep_alive_zero_on_each_http_api_unloads_its_model_once_answered(
    ggufs: dict[str, Path],
) -> None:
    """Ollama's per-request keep_alive, as an extension of every HTTP dialect:
    0 unloads the model as soon as the request is done; a bad value is a 400
    naming the field."""
    import anthropic
    import openai

    async with serving(two_models(ggufs)) as server:
        base = f"http://127.0.0.1:{server.port}"
        client = openai.AsyncOpenAI(
            base_url=base + "/v1", api_key="unused", max_retries=0, timeout=timeout(60)
        )
        claude = anthropic.AsyncAnthropic(
            base_url=base, api_key="unused", max_retries=0, timeout=timeout(60)
        )
        chat: Any = [{"role": "user", "content": "Hi"}]

        async def beta_state() -> str:
            listed = await client.models.list()
            return {m.id: m.model_extra["state"] for m in listed.data}["beta"]  # type: ignore[index]

        asks: dict[str, Callable[[Any], Awaitable[Any]]] = {
            "chat": lambda keep: client.chat.completions.create(
                model="beta", messages=chat, max_tokens=4, extra_body={"keep_alive": keep}
            ),
            "completions": lambda keep: client.completions.create(
                model="beta", prompt="Hi", max_tokens=4, extra_body={"keep_alive": keep}
            ),
            "responses": lambda keep: client.responses.create(
                model="beta", input="Hi", max_output_tokens=4, extra_body={"keep_alive": keep}
            ),
            "messages": lambda keep: claude.messages.create(
                model="beta", max_tokens=4, messages=chat, extra_body={"keep_alive": keep}
            ),
        }
        try:
            for api, ask in asks.items():
                loads = server.models.models["beta"].loads
                answer = await ask(0)
                assert answer.model == "beta", api
                assert server.models.models["beta"].loads == loads + 1, api
                async with asyncio.timeout(timeout(10)):
                    await server.models.wait_state("beta", "unloaded")
                assert await beta_state() == "unloaded", api
            # -1: kept (until its memory is needed), and the next request finds it loaded.
            await asks["chat"](-1)
            assert await beta_state() == "loaded"
            for api, ask in asks.items():
                for bad in (-2, "5m", True):
                    error: type[Exception] = (
                        anthropic.BadRequestError if api == "messages" else openai.BadRequestError
                    )
                    with pytest.raises(error) as caught:
                        await ask(bad)
                    assert "keep_alive" in str(caught.value), (api, bad, caught.value)
            assert await beta_state() == "loaded"
        finally:
            await client.close()
            await claude.close()


async def test_the_python_clients_and_the_cli_chat_choose_the_model(
    ggufs: dict[str, Path], alone: dict[str, str]
) -> None:
    import io

    from wsserver_client import Client
    from wsserver_client.cli import Chat
    from wsserver_client.sync import Client as SyncClient

    async with serving(two_models(ggufs)) as server:
        async with Client(server.url) as client:
            assert client.hello is not None and client.hello.models is not None
            assert [m.name for m in client.hello.models] == ["alpha", "beta"]
            stream = client.generate(GREEDY["prompt"], model="beta", max_tokens=24, temperature=0)
            assert "".join([piece async for piece in stream]) == alone["beta"]
            done = await stream.wait_done()
            assert done is not None and done.model == "beta"
        async with Client(server.url, model="beta") as client:
            result = await client.generate(GREEDY["prompt"], max_tokens=4).result()
            assert result.done.model == "beta"

        def sync_scenario() -> tuple[str, str | None]:
            with SyncClient(server.url, model="beta") as client:
                result = client.generate(GREEDY["prompt"], max_tokens=24, temperature=0).result()
                other = client.generate("x", model="alpha", max_tokens=2).wait_done()
                return result.text, other.model if other is not None else None

        text, other_model = await asyncio.to_thread(sync_scenario)
        assert (text, other_model) == (alone["beta"], "alpha")
        async with Client(server.url) as client:
            out = io.StringIO()
            chat = Chat(
                client, out=out, options={"model": "beta", "max_tokens": 24, "temperature": 0}
            )
            assert await chat.handle(GREEDY["prompt"] + "\n")
            assert alone["beta"] in out.getvalue()
            assert await chat.handle("/set model=nope\n")
            assert await chat.handle("hi\n")
            assert "[refused: model_not_found" in out.getvalue()


async def test_requests_racing_an_unload_are_served_by_a_reload(
    ggufs: dict[str, Path], alone: dict[str, str]
) -> None:
    """keep_alive 0 unloads beta the moment it is idle; requests that arrive
    around that moment wait (queued, loading) and are served once it is back:
    none is handed a slot of a model being unloaded."""
    async with serving(two_models(ggufs)) as server, wire(server) as one, wire(server) as two:
        for round_ in range(4):
            first, second = f"a{round_}", f"b{round_}"
            await one.send(
                {"type": "generate", "id": first, "model": "beta", "keep_alive": 0, **GREEDY}
            )
            await one.until(lambda f, first=first: f["type"] == "delta" and f["id"] == first)
            await two.send({"type": "generate", "id": second, "model": "beta", **GREEDY})
            (text_a, _), (text_b, frames) = await asyncio.gather(
                one.done(first, units=60), two.done(second, units=60)
            )
            assert text_a == text_b == alone["beta"], frames
            assert frames[-1]["model"] == "beta"


def test_a_models_memory_counts_its_embedding_context(ggufs: dict[str, Path]) -> None:
    """llama.cpp sizes an embedding context's compute buffer for the output
    head over every position of a decode, and — a generative model's inputs
    read in pieces of 128 tokens — its output buffer for every position's
    logits (~270 MiB for the default model): the budget counts it before the
    load, and nothing for a model served without embeddings (embed_batch 0)."""
    path = ggufs["alpha"]
    with_embeddings = estimate(path)
    without = LlamaBackend(model=str(path), n_ctx=256, parallel=2, embed_batch=0).memory_estimate()
    n_vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    assert n_vocab > 0
    assert with_embeddings - without >= 2 * PIECE_TOKENS * n_vocab * 4
    smaller = LlamaBackend(model=str(path), n_ctx=256, parallel=2, embed_batch=128)
    assert without < smaller.memory_estimate() < with_embeddings

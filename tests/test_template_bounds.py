"""Hostile chat templates (issue 34, faults 1-4 and 8): bounded at load and per request.

A GGUF's chat template is code from a downloaded file. These are the
templates the attack used — a nested ``range(100000)`` loop, a macro that
doubles itself, Jinja's constant folding at compile time, ``~`` doubling,
``'a' * 4000000`` in a loop, ``tojson(indent=10**8)``, ``ljust(300000000)``,
``wordwrap(1)`` on 4 MB — each made a load never end or a request freeze the
server (the event loop, the engine) before the templates got their worker
processes (wsserver/backends/llama_template_pool.py). Each test here failed
before that.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from conftest import running_server, timeout, wire  # noqa: E402
from test_llama_backend import llama_config, loaded  # noqa: E402
from test_security import http  # noqa: E402
from tiny_gguf import write_tiny_gguf  # noqa: E402

from wsserver.aio import Server  # noqa: E402
from wsserver.backends import llama_template  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.backends.llama_template_pool import TemplateBounds, TemplatePool  # noqa: E402
from wsserver.core.protocol import Generate, Limits, parse_client_frame  # noqa: E402
from wsserver.errors import ModelLoadError, ProtocolError  # noqa: E402

#: A plain chat template; the bombs below are added to it.
SIMPLE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: Bombs that take time (each far beyond any bound: minutes to hours of work).
NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING_MACRO = (
    "{% macro d(n) %}{% if n > 0 %}{{ d(n - 1) }}{{ d(n - 1) }}{% endif %}{% endmacro %}{{ d(26) }}"
)
#: One 4 MB word wrapped at width 1: quadratic inside textwrap (> 30 s here).
WORDWRAP = "{{ ('x' * 4000000) | wordwrap(1) }}"
TIME_BOMBS = {"nested_range": NESTED_RANGE, "doubling_macro": DOUBLING_MACRO, "wordwrap": WORDWRAP}

#: Bombs that take memory (each far beyond the default 256 MiB).
MEMORY_BOMBS = {
    "mul_in_a_loop": "{% for i in range(100) %}{{ 'a' * 4000000 }}{% endfor %}",
    "tilde_doubling": (
        "{% set s = namespace(v='ab') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}"
        "{% endfor %}{{ s.v | length }}"
    ),
    "tojson_indent": "{{ messages | tojson(indent=10**8) }}",
    "ljust": "{{ 'a'.ljust(300000000) }}",
}

TIME_KEY = "backend.llama.template.timeout_s"
MEMORY_KEY = "backend.llama.template.memory_bytes"
#: The default memory bound, and time enough to reach it on a loaded machine
#: (a memory bomb takes ~0.2 s to exhaust 256 MiB here, ten times that with two
#: CPU-bound processes beside it): memory is the bound these tests hit.
MEMORY_FIRST = TemplateBounds(timeout_s=timeout(30))  # timing-ok: see above


def triggered(word: str, bomb: str) -> str:
    """SIMPLE, with ``bomb`` run only when the last message says ``word``
    (so that the model loads, and one request sets it off)."""
    return SIMPLE + "{% if messages[-1].content == '" + word + "' %}" + bomb + "{% endif %}"


def chat(content: str) -> Generate:
    message = {"role": "user", "content": content}
    frame = parse_client_frame(
        json.dumps({"type": "generate", "id": "r", "messages": [message]}), Limits()
    )
    assert isinstance(frame, Generate)
    return frame


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[TemplatePool]:
    """Every TemplatePool made while the test runs (to see their workers)."""
    made: list[TemplatePool] = []
    original = TemplatePool.__init__

    def recording(self: TemplatePool, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(TemplatePool, "__init__", recording)
    return made


def reaped(pools: list[TemplatePool]) -> bool:
    """No worker of these pools is running, nor left unreaped."""
    for pool in pools:
        for pid in (*pool.pids(), *pool.started):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            return False
    return True


class Events:
    """A pool's events (``sent``, ``answered``, ``overran``, ...), awaitable from the loop."""

    def __init__(self, pool: TemplatePool) -> None:
        self.seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        pool.on_event = self._on_event

    def _on_event(self, event: str, pid: int) -> None:
        with self._lock:
            self.seen.append((event, pid))
        self._loop.call_soon_threadsafe(self._changed.set)

    async def wait(self, event: str, pid: int | None = None, units: float = 10) -> int:
        """The pid of the first ``event`` (of ``pid``, if given) seen so far or next."""
        async with asyncio.timeout(timeout(units)):
            while True:
                self._changed.clear()
                with self._lock:
                    for name, who in self.seen:
                        if name == event and pid in (None, who):
                            return who
                await self._changed.wait()

    def ended(self, pid: int) -> bool:
        with self._lock:
            return any(who == pid and name != "sent" for name, who in self.seen)


def backend_of(server: Server) -> LlamaBackend:
    backend = server.models.default.backend
    assert isinstance(backend, LlamaBackend)
    return backend


# ---------------------------------------------------------------- per request


@pytest.mark.parametrize("bomb", ["nested_range", "doubling_macro"])
async def test_a_template_bomb_in_a_request_is_a_400_and_nothing_else_waits(
    tmp_path: Path, bomb: str
) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=triggered("boom", TIME_BOMBS[bomb]))
    # The bound is generous so that everything below happens while the bomb
    # runs — and is proven to (the bomb's worker had not ended yet).
    config = llama_config(
        path,
        backend__llama__template__timeout_s=timeout(5),  # timing-ok: the checks below take ms
        backend__llama__parallel=2,
    )
    async with running_server(config) as server, wire(server) as client:
        events = Events(backend_of(server).templates)  # type: ignore[arg-type]
        boom = {"role": "user", "content": "boom"}
        await client.send({"type": "generate", "id": "bomb", "messages": [boom]})
        bomb_worker = await events.wait("sent")
        # While the bomb runs in its worker: the event loop answers, and the
        # same model takes, renders (another worker) and serves another
        # client's request. (This connection reads its next frame once the
        # bomb's check has ended, as for any check.)
        status, _, body = await http(server, "/healthz")
        assert status == 200, body
        async with wire(server) as other:
            hi = {"role": "user", "content": "hi"}
            await other.send({"type": "generate", "id": "c", "messages": [hi], "max_tokens": 4})
            text, frames = await other.done("c")
        assert frames[-1]["reason"] == "length" and text
        assert not events.ended(bomb_worker), "the bomb ended before the checks: raise the bound"
        # Then the bomb's worker is killed at the deadline: a 400 naming the bound.
        [error] = await client.until(lambda f: f.get("id") == "bomb", units=30)
        assert (error["type"], error["code"]) == ("error", "bad_request")
        assert TIME_KEY in error["message"], error
        assert await events.wait("overran") == bomb_worker


async def test_over_http_the_bound_is_a_400_and_a_client_that_leaves_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=triggered("boom", NESTED_RANGE))
    # timing-ok: a short bound for the bomb; the load's probe renders take milliseconds
    config = llama_config(path, backend__llama__template__timeout_s=timeout(1))
    async with running_server(config) as server:
        pool = backend_of(server).templates
        assert pool is not None
        events = Events(pool)
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(
                    model="t", messages=[{"role": "user", "content": "boom"}]
                )
            assert refused.value.status_code == 400
            assert TIME_KEY in str(refused.value)
        finally:
            await api.close()
        # A WebSocket client that sends the bomb and goes away at once.
        async with wire(server) as client:
            await client.send(
                {"type": "generate", "id": "b", "messages": [{"role": "user", "content": "boom"}]}
            )
            worker = await events.wait("sent", units=10)
        # Its render does not run on: the deadline kills the worker, and reaps it.
        assert await events.wait("overran", pid=worker) == worker
        assert worker not in pool.pids()
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)


@pytest.mark.parametrize("bomb", sorted(MEMORY_BOMBS))
def test_a_memory_bomb_in_a_request_is_refused_naming_the_memory_bound(
    tmp_path: Path, bomb: str, pools: list[TemplatePool]
) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=triggered("boom", MEMORY_BOMBS[bomb]))
    with loaded(path, template_bounds=MEMORY_FIRST) as backend:
        backend.check(chat("hi"))
        with pytest.raises(ProtocolError) as refused:
            backend.check(chat("boom"))
        assert refused.value.code == "bad_request"
        assert MEMORY_KEY in str(refused.value)
        backend.check(chat("hi again"))  # a new worker took its place
    assert reaped(pools)


def test_wordwrap_on_four_megabytes_in_a_request_is_refused_naming_the_time_bound(
    tmp_path: Path, pools: list[TemplatePool]
) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=triggered("boom", WORDWRAP))
    with loaded(path) as backend:
        with pytest.raises(ProtocolError) as refused:
            backend.check(chat("boom"))
        assert refused.value.code == "bad_request"
        assert TIME_KEY in str(refused.value)
    assert reaped(pools)


# ---------------------------------------------------------------- at load


@pytest.mark.parametrize(
    ("bomb", "key"),
    [(name, TIME_KEY) for name in TIME_BOMBS] + [(name, MEMORY_KEY) for name in MEMORY_BOMBS],
)
def test_a_template_that_bombs_at_load_fails_the_load_naming_the_bound(
    tmp_path: Path, bomb: str, key: str, pools: list[TemplatePool]
) -> None:
    source = SIMPLE + {**TIME_BOMBS, **MEMORY_BOMBS}[bomb]
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=source)
    bounds = MEMORY_FIRST if key == MEMORY_KEY else TemplateBounds()
    with pytest.raises(ModelLoadError, match=re.escape(key)):
        LlamaBackend(model=str(path), n_threads=1, template_bounds=bounds).load()
    assert reaped(pools)  # no core left burning


async def test_a_model_whose_template_bombs_at_load_is_model_load_failed_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    default = write_tiny_gguf(tmp_path / "fine.gguf", chat_template=SIMPLE)
    hostile = write_tiny_gguf(tmp_path / "hostile.gguf", chat_template=SIMPLE + DOUBLING_MACRO)
    config = llama_config(
        default,
        backend__llama__models=[{"name": "hostile", "model": str(hostile)}],
        backend__llama__template__timeout_s=timeout(1),  # timing-ok: the bomb's bound
    )
    async with running_server(config) as server, wire(server) as client:
        hi = [{"role": "user", "content": "hi"}]
        await client.send({"type": "generate", "id": "h", "model": "hostile", "messages": hi})
        frames = await client.until(lambda f: f["type"] in ("error", "done"), units=30)
        error = frames[-1]
        assert (error["type"], error["code"]) == ("error", "model_load_failed")
        assert "hostile" in error["message"] and TIME_KEY in error["message"]
        assert server.models.models["hostile"].state == "unloaded"
        await client.send({"type": "generate", "id": "f", "messages": hi, "max_tokens": 4})
        _, frames = await client.done("f")
        assert frames[-1]["reason"] == "length"
    assert any(
        r.levelname == "ERROR"
        and "hostile failed to load" in r.getMessage()
        and TIME_KEY in r.getMessage()
        for r in caplog.records
    )


def test_the_server_never_compiles_a_template_itself_so_constant_folding_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pools: list[TemplatePool]
) -> None:
    # Fault 3: Jinja folds constants while compiling, and '%' is not
    # intercepted by the sandbox: in a branch never taken, this took 3.6 s and
    # 1.1 GiB of the server's memory at load. The server's process now never
    # compiles a template (this one would raise), a worker does, bounded:
    # there the folding runs out of memory, Jinja gives up folding it, and
    # the template loads — a branch never taken costs nothing.
    def in_the_server(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a chat template was compiled in the server's process")

    monkeypatch.setattr(llama_template.ChatTemplate, "__init__", in_the_server)
    fold = "{% if messages | length > 1000 %}{{ '%0300000000d' % 1 }}{% endif %}"
    path = write_tiny_gguf(tmp_path / "fold.gguf", chat_template=SIMPLE + fold)
    with loaded(path) as backend:
        assert backend.chat.template is not None
        backend.check(chat("hi"))
    # A width the worker can fold but not compile into code: the load fails on memory.
    fits = "{% if messages | length > 1000 %}{{ '%0100000000d' % 1 }}{% endif %}"
    path = write_tiny_gguf(tmp_path / "fits.gguf", chat_template=SIMPLE + fits)
    with pytest.raises(ModelLoadError, match=re.escape(MEMORY_KEY)):
        LlamaBackend(model=str(path), n_threads=1, template_bounds=MEMORY_FIRST).load()
    assert reaped(pools)


# ---------------------------------------------------------------- an empty prompt


async def test_a_template_that_renders_an_empty_prompt_is_a_400(tmp_path: Path) -> None:
    empty = "{% for m in messages %}{% endfor %}"
    path = write_tiny_gguf(tmp_path / "empty.gguf", chat_template=empty)
    async with running_server(llama_config(path)) as server, wire(server) as client:
        hi = [{"role": "user", "content": "hi"}]
        await client.send({"type": "generate", "id": "e", "messages": hi})
        error = await client.recv()
        assert (error["type"], error["id"], error["code"]) == ("error", "e", "bad_request")
        assert "empty prompt" in error["message"]
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(model="empty", messages=hi)  # type: ignore[arg-type]
            assert refused.value.status_code == 400
            assert "empty prompt" in str(refused.value)
        finally:
            await api.close()


# ---------------------------------------------------------------- one render per request


async def test_a_request_renders_each_distinct_input_once(tmp_path: Path) -> None:
    # The check, the preparation before the engine, the loop's questions (does
    # it open a think block, does the template show the tools) and the
    # engine's admission all need the same render: it runs once (twice with
    # tools: with them and without, to see whether the template shows them).
    tools_template = "{% if tools %}TOOLS{{ tools | tojson }}\n{% endif %}" + SIMPLE
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=tools_template)
    async with running_server(llama_config(path)) as server, wire(server) as client:
        events = Events(backend_of(server).templates)  # type: ignore[arg-type]
        hi = [{"role": "user", "content": "hi"}]
        await client.send({"type": "generate", "id": "a", "messages": hi, "max_tokens": 2})
        await client.done("a")
        assert [e for e, _ in events.seen].count("sent") == 1
        events.seen.clear()
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        again = [{"role": "user", "content": "hi, with tools"}]
        await client.send(
            {"type": "generate", "id": "b", "messages": again, "tools": [tool], "max_tokens": 2}
        )
        await client.done("b")
        assert [e for e, _ in events.seen].count("sent") == 2

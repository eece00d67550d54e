"""The chat template worker pool: renders as in-process, bounds, kills, reaps.

No model needed: the pool only runs Jinja. The hostile templates on a real
model, at load and per request over the wires, are in test_template_bounds.py.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import timeout

from wsserver.backends.llama_template import ChatTemplate, TemplateLoadError
from wsserver.backends.llama_template_pool import (
    BoundedTemplate,
    TemplateBoundError,
    TemplateBounds,
    TemplatePool,
)
from wsserver.backends.llama_template_worker import encode_frame, read_frame
from wsserver.core.protocol import Message, ToolCall
from wsserver.errors import BackendError

TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<call>{{ call.function | tojson }}</call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STRICT = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
    "{{ m.content }}{% endfor %}"
)
LOOP_ON_BOOM = (
    "{{ messages[-1].content }}{% if messages[-1].content == 'boom' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
)
MEMORY_ON_BOOM = (
    "{{ messages[-1].content }}{% if messages[-1].content == 'boom' %}"
    "{% for i in range(100) %}{{ 'a' * 4000000 }}{% endfor %}{% endif %}"
)
CONVERSATION = (
    Message("developer", "Be brief."),
    Message("user", "Weather in Paris? 日本 🙂"),
    Message("assistant", "", tool_calls=(ToolCall("c1", "weather", '{"city": "Paris"}'),)),
    Message("tool", "18 C", tool_call_id="c1"),
)
TIME_KEY = "backend.llama.template.timeout_s"
MEMORY_KEY = "backend.llama.template.memory_bytes"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture
def pool() -> Iterator[TemplatePool]:
    # A generous bound: what a test here bounds is memory, or a kill from
    # outside, never time (a memory bomb takes ~0.2 s to exhaust 256 MiB here,
    # ten times that with two CPU-bound processes beside it).
    made = TemplatePool(TemplateBounds(timeout_s=timeout(30)))  # timing-ok: see above
    try:
        yield made
    finally:
        made.close()
        assert_reaped(made)


def assert_reaped(pool: TemplatePool) -> None:
    assert pool.pids() == []
    for pid in pool.started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class Events:
    """A pool's events, seen from a test's thread."""

    def __init__(self, pool: TemplatePool) -> None:
        self.seen: list[tuple[str, int]] = []
        self._cond = threading.Condition()
        pool.on_event = self._on_event

    def _on_event(self, event: str, pid: int) -> None:
        with self._cond:
            self.seen.append((event, pid))
            self._cond.notify_all()

    def wait(self, event: str) -> int:
        with self._cond:
            assert self._cond.wait_for(
                lambda: any(e == event for e, _ in self.seen), timeout(10)
            ), self.seen
            return next(pid for e, pid in self.seen if e == event)

    def count(self, event: str) -> int:
        with self._cond:
            return sum(1 for e, _ in self.seen if e == event)


def in_thread(call: Any) -> tuple[threading.Thread, list[BaseException | str]]:
    outcome: list[BaseException | str] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_worker_renders_exactly_what_the_template_renders_in_process(
    pool: TemplatePool,
) -> None:
    for source in (TOOLS_TEMPLATE, STRICT):
        bounded = pool.load(source, bos_token="<s>", eos_token="</s>")
        here = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
        assert bounded.string_content == here.string_content
        inputs: list[tuple[Any, dict[str, Any]]] = [
            ((Message("user", "hi"),), {}),
            (CONVERSATION, {"tools": TOOLS}),
            (CONVERSATION, {"add_generation_prompt": False, "extra": {"x": [1, "ü"]}}),
        ]
        for messages, kwargs in inputs:
            try:
                expected: str | BaseException = here.render(messages, **kwargs)
            except BackendError as exc:
                expected = exc
            if isinstance(expected, str):
                assert bounded.render(messages, **kwargs) == expected
            else:
                with pytest.raises(BackendError) as caught:
                    bounded.render(messages, **kwargs)
                assert (caught.value.code, str(caught.value)) == (expected.code, str(expected))
    with pytest.raises(TemplateLoadError, match="does not compile"):
        pool.load("{% for %}")


def test_a_render_past_the_deadline_is_killed_reaped_and_replaced() -> None:
    # timing-ok: a short bound for the bomb; the other renders here take milliseconds
    pool = TemplatePool(TemplateBounds(timeout_s=timeout(0.5)))
    try:
        template = pool.load(LOOP_ON_BOOM)
        events = Events(pool)
        [first] = pool.pids()
        with pytest.raises(TemplateBoundError, match=re.escape(TIME_KEY)) as caught:
            template.render((Message("user", "boom"),))
        assert (caught.value.code, caught.value.bound) == ("bad_request", "time")
        assert events.wait("overran") == first
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # killed and reaped
        # The next render gets a new worker, which compiles the template first.
        assert template.render((Message("user", "fine"),)) == "fine"
        assert first not in pool.pids() and len(pool.pids()) == 1
        assert events.count("sent") == 3  # the bomb, then the new worker's load and render
    finally:
        pool.close()
    assert_reaped(pool)


def test_a_render_past_the_memory_bound_is_refused_and_its_worker_replaced(
    pool: TemplatePool,
) -> None:
    template = pool.load(MEMORY_ON_BOOM)
    [first] = pool.pids()
    with pytest.raises(TemplateBoundError, match=re.escape(MEMORY_KEY)) as caught:
        template.render((Message("user", "boom"),))
    assert caught.value.bound == "memory"
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)
    assert template.render((Message("user", "fine"),)) == "fine"


def test_a_worker_killed_from_outside_is_reaped_and_named_as_memory(pool: TemplatePool) -> None:
    # The kernel's OOM killer sends SIGKILL: the render is refused on memory.
    template = pool.load(LOOP_ON_BOOM)
    events = Events(pool)
    thread, outcome = in_thread(lambda: template.render((Message("user", "boom"),)))
    os.kill(events.wait("sent"), signal.SIGKILL)
    thread.join(timeout(10))
    [error] = outcome
    assert isinstance(error, TemplateBoundError) and error.bound == "memory"
    # Killed while idle: found dead at the next call, and replaced.
    assert template.render((Message("user", "a"),)) == "a"
    [worker] = pool.pids()
    os.kill(worker, signal.SIGKILL)
    os.waitid(os.P_PID, worker, os.WEXITED | os.WNOWAIT)  # it is dead (not reaped yet)
    assert template.render((Message("user", "b"),)) == "b"
    assert worker not in pool.pids()


def test_close_ends_a_busy_worker_and_its_caller_gets_an_error() -> None:
    pool = TemplatePool(TemplateBounds(timeout_s=timeout(30)))
    template = pool.load(LOOP_ON_BOOM)
    events = Events(pool)
    thread, outcome = in_thread(lambda: template.render((Message("user", "boom"),)))
    events.wait("sent")
    pool.close()
    thread.join(timeout(10))
    [error] = outcome
    assert isinstance(error, BackendError) and error.code == "overloaded"
    assert_reaped(pool)
    with pytest.raises(BackendError, match="unloaded"):
        template.render((Message("user", "later"),))


def test_a_pool_dropped_without_close_reaps_its_workers() -> None:
    pool = TemplatePool()
    pool.load(STRICT)
    [pid] = pool.pids()
    del pool
    gc.collect()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_request_renders_once_and_a_refusal_or_a_bound_is_remembered() -> None:
    # timing-ok: a short bound for the bomb; the other renders here take milliseconds
    pool = TemplatePool(TemplateBounds(timeout_s=timeout(0.5)))
    try:
        events = Events(pool)
        template = pool.load(STRICT + LOOP_ON_BOOM)
        sent = events.count("sent")
        for _ in range(3):
            assert template.render((Message("user", "hi"),)) == "hihi"
        for _ in range(3):
            with pytest.raises(BackendError, match="Only user and assistant"):
                template.render((Message("system", "s"),))
        for _ in range(3):
            with pytest.raises(TemplateBoundError):
                template.render((Message("user", "boom"),))
        # One render each, and one load in the worker that replaced the killed one.
        assert events.count("sent") - sent == 3
        assert isinstance(template, BoundedTemplate)
    finally:
        pool.close()


def test_a_worker_whose_parent_stops_listening_ends_by_its_cpu_backstop() -> None:
    # The parent's deadline is the bound; RLIMIT_CPU is what ends a worker
    # whose parent is gone or stuck mid-render.
    worker = subprocess.Popen(
        [sys.executable, "-m", "wsserver.backends.llama_template_worker", str(256 << 20), "0.2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert worker.stdin is not None and worker.stdout is not None
        assert read_frame(worker.stdout) == {"ready": True}
        load = {"op": "load", "key": "k", "source": LOOP_ON_BOOM, "bos": "", "eos": ""}
        worker.stdin.write(encode_frame(load))
        worker.stdin.flush()
        assert read_frame(worker.stdout) == {"string_content": False}
        render = {
            "op": "render",
            "key": "k",
            "messages": [{"role": "user", "content": "boom"}],
            "tools": None,
            "extra": None,
            "add_generation_prompt": True,
        }
        worker.stdin.write(encode_frame(render))
        worker.stdin.flush()
        assert worker.wait(timeout(30)) == -signal.SIGXCPU
    finally:
        worker.kill()
        worker.wait()
        for stream in (worker.stdin, worker.stdout):
            if stream is not None:
                stream.close()

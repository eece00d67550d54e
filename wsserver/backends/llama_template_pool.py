"""Chat templates compiled and rendered in worker processes, bounded in time and memory.

Theory of operation
-------------------
A GGUF's chat template is code from a downloaded file. The Jinja sandbox
(:mod:`.llama_template`) stops escapes, not bombs: a nested loop, a macro
that doubles itself, one native string operation (``'a'.ljust(3e8)``,
``wordwrap``, ``'%0300000000d' % 1`` folded while *compiling*) takes a core or a
gigabyte, and nothing inside the interpreter can interrupt a native call or
cap its memory. So the server never compiles nor renders a template itself:
a :class:`TemplatePool` of long-lived worker processes
(:mod:`.llama_template_worker`, started with ``subprocess``, never forked
from this multi-threaded process) does, each under its own address-space
limit (``RLIMIT_AS`` = ``memory_bytes``), and the calling thread waits for
the answer at most ``timeout_s``. A worker that overruns is killed and
reaped, one that ran out of memory exits, one that died is reaped; either
way the pool starts another on the next call. The caller gets a
:class:`TemplateBoundError` (``bad_request``) that names the bound.

A pool serves one model (its backend owns and closes it): a hostile
template, or a hostile request against it, can keep busy only its own
model's workers. ``workers`` processes at most; a call waits for a free one
at most ``timeout_s`` too, then is refused as ``overloaded``. The first
worker is started at load (which compiles the template and runs its probe
there); the others when a call finds every worker busy.

:class:`BoundedTemplate` is the model's template as the backend sees it —
the interface of :class:`~.llama_template.ChatTemplate` — and remembers its
recent renders (prompt or refusal) by a digest of their input, for a minute
at most and within a character budget: one request's check, its admission
and the loop-side questions about its prompt (does it open a think block,
does the template show the tools) ask for the same render, which then runs
once. A render's cost over IPC is measured in docs/benchmarks.md
("Bounded chat templates").
"""

from __future__ import annotations

import collections
import hashlib
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from ..core.protocol import Message
from ..errors import BackendError
from .llama_template import TemplateLoadError, template_messages
from .llama_template_worker import (
    EXIT_MEMORY,
    MAX_FRAME_BYTES,
    Died,
    Overran,
    WorkerProcess,
    encode_frame,
)

__all__ = ["BoundedTemplate", "TemplateBoundError", "TemplateBounds", "TemplatePool"]

log = logging.getLogger("wsserver.llama")

Bound = Literal["time", "memory"]

#: A worker's start (an interpreter, Jinja) must say ``ready`` within this.
START_TIMEOUT_S: Final = 30.0
#: Renders remembered per template: at most this many, this many characters
#: of prompts together, this long (a prompt may carry today's date).
_MEMO_ENTRIES: Final = 64
_MEMO_CHARS: Final = 8 << 20
_MEMO_TTL_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class TemplateBounds:
    """What one compile or one render may take (``[backend.llama.template]``)."""

    #: Wall-clock seconds per compile (with the load-time probe) or render.
    timeout_s: float = 2.0
    #: A worker's address space, bytes (the interpreter's own ~30 MiB included).
    memory_bytes: int = 256 << 20
    #: Worker processes per model.
    workers: int = 2


class TemplateBoundError(BackendError):
    """A chat template exceeded a bound and was stopped (wire code ``bad_request``)."""

    def __init__(self, bound: Bound, bounds: TemplateBounds) -> None:
        if bound == "time":
            message = (
                f"the chat template took longer than {bounds.timeout_s:g} s "
                "(backend.llama.template.timeout_s) and was stopped"
            )
        else:
            message = (
                f"the chat template needed more than {bounds.memory_bytes / (1 << 20):g} MiB "
                "of memory (backend.llama.template.memory_bytes) and was stopped"
            )
        super().__init__(message, code="bad_request")
        self.bound: Bound = bound
        self.bounds = bounds


def _close_all(workers: set[WorkerProcess]) -> None:
    for worker in list(workers):
        worker.kill()
        worker.close()
    workers.clear()


class TemplatePool:
    """Worker processes that compile and render one model's chat template (see the module docstring)."""

    def __init__(self, bounds: TemplateBounds | None = None) -> None:
        self.bounds = bounds or TemplateBounds()
        self._cond = threading.Condition()
        self._idle: list[WorkerProcess] = []
        #: Every started worker not yet reaped (idle or in a call).
        self._workers: set[WorkerProcess] = set()
        #: Workers started or starting.
        self._live = 0
        #: The latest workers' pids, reaped or not (tests check none is left).
        self.started: collections.deque[int] = collections.deque(maxlen=64)
        self._closed = False
        #: Called with what happened and the worker's pid: ``sent`` (a
        #: compile or render went to it), ``answered``, ``overran`` (killed at
        #: the deadline), ``memory``, ``died``. On the calling thread; for
        #: tests and metrics: quick, must not raise.
        self.on_event: Callable[[str, int], None] | None = None
        # A pool dropped without close() (a test's backend) still reaps its workers.
        self._finalizer = weakref.finalize(self, _close_all, self._workers)

    # ------------------------------------------------------------ the backend's side

    def load(self, source: str, *, bos_token: str = "", eos_token: str = "") -> BoundedTemplate:
        """Compile ``source`` in a worker and run its load-time probe there.

        Raises :class:`~.llama_template.TemplateLoadError` if it does not
        compile, :class:`TemplateBoundError` if it exceeded a bound, and
        :class:`~wsserver.errors.BackendError` if no worker could start."""
        template = BoundedTemplate(self, source, bos_token=bos_token, eos_token=eos_token)
        reply = self._call(template, None)
        if "error" in reply:
            raise TemplateLoadError(str(reply["error"]))
        template.string_content = bool(reply["string_content"])
        return template

    def render(self, template: BoundedTemplate, frame: bytes) -> str:
        """The prompt of one render frame; :class:`BackendError` as the template fails."""
        reply = self._call(template, frame)
        if "error" in reply:
            raise BackendError(str(reply["error"])[:400], code=reply.get("code", "internal"))
        prompt: str = reply["prompt"]
        return prompt

    def pids(self) -> list[int]:
        """The worker processes not yet reaped (tests, leak checks)."""
        with self._cond:
            return sorted(worker.pid for worker in self._workers)

    def close(self) -> None:
        """End every worker (a busy one is killed; its caller gets an error) and reap it."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = [worker for worker in self._workers if worker not in idle]
            self._cond.notify_all()
        for worker in busy:
            worker.healthy = False
            if worker.process.poll() is None:
                worker.process.kill()
        for worker in idle:
            worker.close()
            with self._cond:
                self._forget(worker)
        with self._cond:
            # The callers of the killed ones see their pipes close at once and
            # hand them back (see _release), which reaps them; a worker still
            # starting is ended as it comes up (see _acquire).
            self._cond.wait_for(lambda: self._live == 0, timeout=START_TIMEOUT_S)
        self._finalizer()

    # ------------------------------------------------------------ one call

    def _call(self, template: BoundedTemplate, frame: bytes | None) -> dict[str, Any]:
        """Load ``template`` in a worker (if it has not), then send ``frame``
        (None: the load is the call) and return the answer."""
        worker = self._acquire(time.monotonic() + self.bounds.timeout_s)
        try:
            if frame is None or template.key not in worker.keys:
                # A worker started after the load (a replacement) compiles it first.
                reply = self._exchange(worker, template.load_frame)
                if "error" in reply:
                    return reply
                worker.keys.add(template.key)
                if frame is None:
                    return reply
            return self._exchange(worker, frame)
        finally:
            self._release(worker)

    def _exchange(self, worker: WorkerProcess, frame: bytes) -> dict[str, Any]:
        deadline = time.monotonic() + self.bounds.timeout_s
        try:
            worker.send(frame, deadline)
            self._tell("sent", worker)
            reply = worker.receive(deadline)
        except Overran:
            worker.kill()
            self._tell("overran", worker)
            log.warning(
                "a chat template ran past %g s: its worker (pid %d) was killed",
                self.bounds.timeout_s,
                worker.pid,
            )
            raise TemplateBoundError("time", self.bounds) from None
        except Died:
            error = self._died(worker)
            self._tell("memory" if isinstance(error, TemplateBoundError) else "died", worker)
            raise error from None
        if "bound" in reply:  # out of memory: it exits after saying so
            worker.kill()
            self._tell("memory", worker)
            log.warning(
                "a chat template ran out of its %d MiB: its worker (pid %d) ended",
                self.bounds.memory_bytes >> 20,
                worker.pid,
            )
            raise TemplateBoundError("memory", self.bounds)
        if reply.get("code") == "internal":
            log.error("template worker (pid %d): %s", worker.pid, reply.get("error"))
        self._tell("answered", worker)
        return reply

    def _tell(self, event: str, worker: WorkerProcess) -> None:
        if self.on_event is not None:
            self.on_event(event, worker.pid)

    def _died(self, worker: WorkerProcess) -> BackendError:
        worker.kill()
        status = worker.process.returncode
        closing = self._closed
        if status == EXIT_MEMORY or (status == -signal.SIGKILL and not closing):
            # -9 that we did not send: the kernel's OOM killer, most likely.
            log.warning("a chat template's worker (pid %d) ran out of memory", worker.pid)
            return TemplateBoundError("memory", self.bounds)
        if status == -signal.SIGXCPU:  # its own CPU backstop
            return TemplateBoundError("time", self.bounds)
        if closing:
            return BackendError("the model is being unloaded", code="overloaded")
        log.error("a chat template's worker (pid %d) died with status %s", worker.pid, status)
        return BackendError("the chat template's worker process died", code="internal")

    # ------------------------------------------------------------ the workers

    def _acquire(self, deadline: float) -> WorkerProcess:
        with self._cond:
            while True:
                if self._closed:
                    raise BackendError("the model is being unloaded", code="overloaded")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.process.poll() is None:
                        return worker
                    # Ended while idle (a signal from outside): reaped already.
                    worker.close()
                    self._forget(worker)
                if self._live < self.bounds.workers:
                    self._live += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BackendError(
                        "every chat template worker of this model is busy "
                        f"(backend.llama.template.workers = {self.bounds.workers}); try again",
                        code="overloaded",
                    )
                self._cond.wait(remaining)
        try:
            worker = self._start()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            if not self._closed:
                self._workers.add(worker)
                return worker
        worker.kill()
        worker.close()
        with self._cond:
            self._live -= 1
            self._cond.notify_all()
        raise BackendError("the model is being unloaded", code="overloaded")

    def _release(self, worker: WorkerProcess) -> None:
        with self._cond:
            if worker.healthy and not self._closed:
                self._idle.append(worker)
                self._cond.notify()
                return
        worker.kill()
        worker.close()
        with self._cond:
            self._forget(worker)

    def _forget(self, worker: WorkerProcess) -> None:
        """(With the lock.) A worker that is gone for good: free its place."""
        if worker in self._workers:
            self._workers.discard(worker)
            self._live -= 1
        worker.process.poll()
        self._cond.notify_all()

    def _start(self) -> WorkerProcess:
        try:
            worker = WorkerProcess.start(
                memory_bytes=self.bounds.memory_bytes,
                timeout_s=self.bounds.timeout_s,
                ready_within_s=START_TIMEOUT_S,
            )
        except Died as exc:
            raise BackendError(
                f"a chat template worker did not start ({exc}); "
                "is backend.llama.template.memory_bytes too small?",
                code="internal",
            ) from None
        self.started.append(worker.pid)
        log.debug("chat template worker started (pid %d)", worker.pid)
        return worker


class BoundedTemplate:
    """A model's chat template, compiled and rendered by a :class:`TemplatePool`.

    The interface of :class:`~.llama_template.ChatTemplate`; made by
    :meth:`TemplatePool.load`. Thread-safe."""

    def __init__(
        self, pool: TemplatePool, source: str, *, bos_token: str = "", eos_token: str = ""
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        #: See :attr:`.llama_template.ChatTemplate.string_content` (the worker's probe says).
        self.string_content = False
        self._pool = pool
        identity = orjson.dumps([source, bos_token, eos_token])
        self.key = hashlib.blake2b(identity, digest_size=32).hexdigest()
        self.load_frame = encode_frame(
            {"op": "load", "key": self.key, "source": source, "bos": bos_token, "eos": eos_token}
        )
        self._memo = _Memo()

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt; :class:`BackendError` (``bad_request``) if the template
        fails or exceeds a bound (:class:`TemplateBoundError`)."""
        try:
            frame = encode_frame(
                {
                    "op": "render",
                    "key": self.key,
                    "messages": template_messages(messages),
                    "tools": tools,
                    "extra": dict(extra) if extra is not None else None,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except TypeError as exc:  # orjson: a value JSON cannot carry (an integer too large)
            raise BackendError(
                f"the chat template's input: {exc}"[:400], code="bad_request"
            ) from None
        if len(frame) > MAX_FRAME_BYTES:
            raise BackendError("the chat template's input is too large", code="too_large")
        digest = hashlib.blake2b(frame, digest_size=32).digest()
        known = self._memo.get(digest)
        if isinstance(known, str):
            return known
        if known is not None:
            raise known()
        try:
            prompt = self._pool.render(self, frame)
        except TemplateBoundError as exc:
            bound, bounds = exc.bound, exc.bounds
            self._memo.put(digest, lambda: TemplateBoundError(bound, bounds), 0)
            raise
        except BackendError as exc:
            message, code = str(exc), exc.code
            if code == "bad_request":  # the template's refusal: the same next time
                self._memo.put(digest, lambda: BackendError(message, code=code), 0)
            raise
        self._memo.put(digest, prompt, len(prompt))
        return prompt


class _Memo:
    """Recent renders by input digest: a prompt, or how to raise its refusal again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[bytes, tuple[float, Any, int]] = (
            collections.OrderedDict()
        )
        self._chars = 0

    def get(self, digest: bytes) -> Any:
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            if now - entry[0] > _MEMO_TTL_S:
                self._drop(digest)
                return None
            self._entries.move_to_end(digest)
            return entry[1]

    def put(self, digest: bytes, value: Any, chars: int) -> None:
        if chars > _MEMO_CHARS:
            return
        with self._lock:
            if digest in self._entries:
                self._drop(digest)
            self._entries[digest] = (time.monotonic(), value, chars)
            self._chars += chars
            while len(self._entries) > _MEMO_ENTRIES or self._chars > _MEMO_CHARS:
                self._drop(next(iter(self._entries)))

    def _drop(self, digest: bytes) -> None:
        _, _, chars = self._entries.pop(digest)
        self._chars -= chars

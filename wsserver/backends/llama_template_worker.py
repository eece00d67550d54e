"""A process that compiles and renders chat templates under a memory bound.

Started by :class:`~.llama_template_pool.TemplatePool` (``python -m
wsserver.backends.llama_template_worker MEMORY_BYTES TIMEOUT_S``), never
forked: the server is multi-threaded. At start it caps its own address space
(``RLIMIT_AS``) at ``MEMORY_BYTES`` — a template that builds too large a
string then gets a :class:`MemoryError`, wherever it allocates: a native
string operation, Jinja's constant folding at compile time, a filter — and
says ``ready``. Then it answers one request at a time from its stdin to its
stdout, each a frame (:func:`write_frame`):

* ``{"op": "load", "key", "source", "bos", "eos"}`` — compile the template
  and run its load-time probe (:class:`~.llama_template.ChatTemplate`); kept
  by ``key`` (a few at most). Answers ``{"string_content": bool}``.
* ``{"op": "render", "key", "messages", "tools", "extra",
  "add_generation_prompt"}`` — the prompt: ``{"prompt": str}``.

A failure answers ``{"error": message, "code": wire code}``; a template that
ran out of memory answers ``{"bound": "memory"}`` and the worker exits (its
heap may be fragmented; the pool starts another). Time is the parent's to
bound: it kills a worker that overruns its deadline. As a backstop against a
parent that is gone or stuck, each request also arms ``RLIMIT_CPU`` a little
beyond the deadline (the kernel then ends the worker), and a closed stdin
ends it. Stray output (a warning) goes to stderr: stdout carries frames only.

:class:`WorkerProcess` is the other end, the parent's handle: it starts a
worker, writes and reads its frames by a deadline (non-blocking pipes and
``poll``, so a caller never waits past it), and kills and reaps it.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Final

import orjson

from ..errors import BackendError
from .llama_template import ChatTemplate, TemplateLoadError

__all__ = [
    "EXIT_MEMORY",
    "HEADER",
    "MAX_FRAME_BYTES",
    "Died",
    "Overran",
    "WorkerProcess",
    "encode_frame",
    "read_frame",
    "write_frame",
]

HEADER: Final = struct.Struct(">I")
#: The largest frame either side accepts (a 4 Mi-character prompt is <= 16 MiB).
MAX_FRAME_BYTES: Final = 64 << 20
#: Exit status of a worker that ran out of memory even for its answer.
EXIT_MEMORY: Final = 3
#: An idle worker asked to exit (its input closed) is killed after this.
EXIT_WAIT_S: Final = 1.0
_MODULE: Final = "wsserver.backends.llama_template_worker"
#: Compiled templates a worker keeps (one per model normally).
_KEPT: Final = 4


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame: the JSON body's length (4 bytes, big-endian), then the body."""
    body = orjson.dumps(message)
    return HEADER.pack(len(body)) + body


def write_frame(stream: IO[bytes], message: dict[str, Any]) -> None:
    stream.write(encode_frame(message))
    stream.flush()


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next frame, or None at the end of the stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes")
    body = stream.read(size)
    if len(body) < size:
        return None
    message: dict[str, Any] = orjson.loads(body)
    return message


class Overran(Exception):
    """The worker did not answer by the deadline."""


class Died(Exception):
    """The worker's pipe closed: it exited or was killed."""


class WorkerProcess:
    """The parent's handle of one worker process: its two pipes (non-blocking,
    read and written by a deadline), and its end."""

    @classmethod
    def start(cls, *, memory_bytes: int, timeout_s: float, ready_within_s: float) -> WorkerProcess:
        """Start a worker (``subprocess``: no fork of the caller's threads) and
        wait for its ``ready``; :class:`Died` if it does not say it in time."""
        # The package's own directory first: the worker imports this copy of wsserver.
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        process = subprocess.Popen(
            [sys.executable, "-m", _MODULE, str(memory_bytes), repr(timeout_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        worker = cls(process)
        try:
            ready = worker.receive(time.monotonic() + ready_within_s)
        except (Overran, Died):
            ready = {}
        if not ready.get("ready"):
            worker.kill()
            worker.close()
            raise Died(f"status {process.returncode}")
        return worker

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.pid = process.pid
        #: The templates (by key) this worker has compiled.
        self.keys: set[str] = set()
        #: False once it overran, ran out of memory or died: never used again.
        self.healthy = True
        self._stdin = process.stdin.fileno()
        self._stdout = process.stdout.fileno()
        os.set_blocking(self._stdin, False)
        os.set_blocking(self._stdout, False)

    def receive(self, deadline: float) -> dict[str, Any]:
        """The next frame from the worker, by ``deadline``."""
        (size,) = HEADER.unpack(self._read(HEADER.size, deadline))
        if size > MAX_FRAME_BYTES:
            raise Died()
        try:
            reply: dict[str, Any] = orjson.loads(self._read(size, deadline))
        except orjson.JSONDecodeError:
            raise Died() from None
        return reply

    def send(self, data: bytes, deadline: float) -> None:
        """Write a frame to the worker, by ``deadline``."""
        view = memoryview(data)
        poller = select.poll()
        poller.register(self._stdin, select.POLLOUT)
        while view:
            try:
                view = view[os.write(self._stdin, view) :]
            except BlockingIOError:
                pass
            except OSError:  # EPIPE: it is gone
                raise Died() from None
            if view:
                _wait(poller, deadline)

    def _read(self, size: int, deadline: float) -> bytes:
        buffer = bytearray()
        poller = select.poll()
        poller.register(self._stdout, select.POLLIN)
        while len(buffer) < size:
            try:
                chunk = os.read(self._stdout, size - len(buffer))
            except BlockingIOError:
                _wait(poller, deadline)
                continue
            if not chunk:
                raise Died()
            buffer += chunk
        return bytes(buffer)

    def kill(self) -> None:
        """Stop it now and reap it (a signal only: safe beside a thread using its pipes)."""
        self.healthy = False
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def close(self) -> None:
        """Ask an idle worker to exit (end of its input), kill it if it does not; reap it."""
        self.healthy = False
        assert self.process.stdin is not None and self.process.stdout is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process.stdout.close()


def _wait(poller: select.poll, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Overran()
    poller.poll(max(1, math.ceil(remaining * 1000)))


def _arm_cpu_limit(seconds: float) -> None:
    """End this process if the next request uses more than ``seconds`` of CPU
    (plus a margin): the parent's deadline comes first, this is the backstop."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used + seconds) + 2
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def main(argv: list[str]) -> int:
    memory_bytes, timeout_s = int(argv[0]), float(argv[1])
    # Ctrl-C in a terminal reaches the whole process group: the server stops
    # its workers itself. No core file from a worker the kernel ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # Frames go to a private copy of stdout; fd 1 becomes stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer

    templates: dict[str, ChatTemplate] = {}
    write_frame(out, {"ready": True})
    while True:
        request = read_frame(inp)
        if request is None:
            return 0  # the parent closed the pipe (or is gone)
        _arm_cpu_limit(timeout_s)
        try:
            reply = _answer(request, templates)
        except MemoryError:
            reply = None
        except Exception as exc:  # a bug here: the parent logs it, the worker goes on
            reply = {"error": f"the template worker failed: {exc!r}"[:400], "code": "internal"}
        if reply is None:
            try:
                write_frame(out, {"bound": "memory"})
            except MemoryError:
                return EXIT_MEMORY
            return 0
        write_frame(out, reply)


def _answer(request: dict[str, Any], templates: dict[str, ChatTemplate]) -> dict[str, Any]:
    key = request["key"]
    if request["op"] == "load":
        try:
            compiled = ChatTemplate(
                request["source"], bos_token=request["bos"], eos_token=request["eos"]
            )
        except TemplateLoadError as exc:
            return {"error": str(exc), "code": "bad_request"}
        except RecursionError:
            return {
                "error": "the chat template does not compile: nested too deeply",
                "code": "bad_request",
            }
        while len(templates) >= _KEPT:
            del templates[next(iter(templates))]
        templates[key] = compiled
        return {"string_content": compiled.string_content}
    template = templates.get(key)
    if template is None:
        return {"error": "the template is not loaded in this worker", "code": "internal"}
    try:
        prompt = template.render_entries(
            request["messages"],
            tools=request["tools"],
            add_generation_prompt=request["add_generation_prompt"],
            extra=request["extra"],
        )
    except BackendError as exc:
        return {"error": str(exc), "code": exc.code}
    return {"prompt": prompt}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One llama.cpp context and what it takes to interrupt it (used by :mod:`.llama`).

ggml calls a context's abort callback after every graph node — hundreds of
times per decoded token, from its compute thread — and stops the running
``llama_decode`` (which then returns 2) when the callback returns true. This
module makes that callback cheap and exact:

* **native** (the default): the callback is libc's ``strlen`` reading a
  two-byte per-context buffer — ``b"\\0\\0"`` → 0 (false), ``b"\\1\\0"`` → 1
  (true) — so no Python runs in the compute thread and the GIL is never
  taken. The flag is raised by a callback on the request's
  :class:`~wsserver.backends.base.CancelEvent`, on the thread that cancels, the
  instant it cancels (for a plain ``threading.Event``, a watcher thread
  blocked on it raises the flag instead);
* **python** (the fallback where libc is not found): a ctypes callback that
  reads the request's cancel event; it takes the GIL on every call.

It also routes llama.cpp's log lines into Python logging.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import llama_cpp

__all__ = ["ContextSlot", "install_log_bridge", "native_flag_reader"]

_cpp_log = logging.getLogger("wsserver.llama.cpp")

# ---------------------------------------------------------------- llama.cpp logs

_log_bridge: Any = None
#: The running request's cancel event, per producer thread (llama.cpp logs on
#: the thread that called llama_decode), to tell an abort from a failure.
_producer = threading.local()


def install_log_bridge() -> None:
    """Route llama.cpp's log lines into ``wsserver.llama.cpp`` instead of stderr."""
    global _log_bridge
    if _log_bridge is not None:
        return

    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. llama.cpp
    # warns about expected events too (an aborted decode), so only its errors
    # are raised above debug.
    levels = {4: logging.WARNING}

    def on_log(level: int, text: bytes, _user_data: Any) -> None:
        line = text.decode("utf-8", errors="replace").rstrip()
        if not line:
            return
        cancel = getattr(_producer, "cancel", None)
        if cancel is not None and cancel.is_set():
            level = 1  # the errors an aborted decode reports: our own cancel
        _cpp_log.log(levels.get(level, logging.DEBUG), "%s", line)

    _log_bridge = llama_cpp.llama_log_callback(on_log)  # kept alive: llama.cpp holds a raw pointer
    llama_cpp.llama_log_set(_log_bridge, ctypes.c_void_p(0))


# ---------------------------------------------------------------- abort flag


def native_flag_reader() -> Any:
    """libc ``strlen`` as a ``ggml_abort_callback``, or None where unavailable.

    Called on a two-byte buffer holding ``\\0\\0`` or ``\\1\\0`` it returns 0 or
    1 — a valid C ``bool`` in the return register — without touching Python.
    """
    try:
        libc = ctypes.CDLL(None)
        address = ctypes.cast(libc.strlen, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):
        return None
    if not address:
        return None
    return llama_cpp.ggml_abort_callback(address)


class _CancelWatcher:
    """For a plain ``threading.Event``: a thread that calls ``on_cancel`` when it is set.

    The thread blocks on the event's own condition variable, so it wakes the
    moment ``cancel.set()`` is called, and :meth:`stop` wakes it at the end of
    the request without setting the event. (``threading.Event`` keeps that
    condition in ``_cond``; if an implementation lacks it we fall back to
    waking every 10 ms.) The server's channel passes a
    :class:`~wsserver.backends.base.CancelEvent`, which needs no thread.
    """

    def __init__(self, cancel: threading.Event, on_cancel: Callable[[], None], name: str) -> None:
        self._cancel = cancel
        self._on_cancel = on_cancel
        self._finished = False
        self._cond: threading.Condition | None = getattr(cancel, "_cond", None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cancel = self._cancel
        if self._cond is not None:
            with self._cond:
                self._cond.wait_for(lambda: self._finished or cancel.is_set())
        else:  # pragma: no cover - CPython's Event always has _cond
            while not self._finished and not cancel.wait(0.01):
                pass
        if cancel.is_set() and not self._finished:
            self._on_cancel()

    def stop(self) -> None:
        if self._cond is not None:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
        else:  # pragma: no cover
            self._finished = True
        self._thread.join()


class ContextSlot:
    """One llama.cpp context and its abort machinery."""

    def __init__(self, index: int, llm: llama_cpp.Llama, native_reader: Any) -> None:
        self.index = index
        self.llm = llm
        #: The running request's cancel event (read by the Python callback).
        self.cancel: threading.Event | None = None
        #: Native mode: the byte the abort callback reads; index 1 stays NUL.
        self.flag = ctypes.create_string_buffer(2)
        self.native = native_reader is not None
        #: Decodes interrupted by the abort callback (for tests and metrics).
        self.aborts = 0
        self.requests = 0
        # Guards (cancel, flag): a late cancel of a finished request must never
        # raise the flag under the next request on this context.
        self._lock = threading.Lock()
        self._watcher: _CancelWatcher | None = None
        self._hook: Callable[[], None] | None = None
        if self.native:
            self._callback = native_reader
            data = ctypes.cast(self.flag, ctypes.c_void_p)
        else:
            self._callback = llama_cpp.ggml_abort_callback(self._should_abort)
            data = ctypes.c_void_p(0)
        # Keep self._callback referenced: llama.cpp holds only a raw pointer.
        llama_cpp.llama_set_abort_callback(llm.ctx, self._callback, data)

    def _should_abort(self, _data: Any) -> bool:
        cancel = self.cancel
        return cancel is not None and cancel.is_set()

    def _raise_flag(self, cancel: threading.Event) -> None:
        with self._lock:
            if self.cancel is cancel:
                self.flag[0] = b"\x01"

    def arm(self, cancel: threading.Event, request_id: str) -> None:
        with self._lock:
            self.cancel = cancel
            self.flag[0] = b"\x00"
        _producer.cancel = cancel
        if not self.native:
            return
        add_callback = getattr(cancel, "add_callback", None)
        if add_callback is not None:
            # A CancelEvent: the canceller itself raises the flag, at once.
            self._hook = functools.partial(self._raise_flag, cancel)
            add_callback(self._hook)
        else:
            self._watcher = _CancelWatcher(
                cancel,
                functools.partial(self._raise_flag, cancel),
                name=f"wsserver-llama-abort-{self.index}-{request_id}",
            )

    def disarm(self) -> None:
        cancel = self.cancel
        if self._hook is not None and cancel is not None:
            cancel.remove_callback(self._hook)  # type: ignore[attr-defined]
        self._hook = None
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        with self._lock:
            self.cancel = None
            self.flag[0] = b"\x00"
        _producer.cancel = None

    def reset(self) -> None:
        """Forget everything the context holds: tokens and KV memory."""
        llm = self.llm
        llm.reset()  # type: ignore[no-untyped-call]
        memory = llama_cpp.llama_get_memory(llm.ctx)
        if memory is not None:
            # Metadata only: emptied cells are never attended, and wiping the
            # buffers (~75 MB for Gemma 3 270M at n_ctx 4096) would hold the
            # context for milliseconds after a cancel.
            llama_cpp.llama_memory_clear(memory, False)

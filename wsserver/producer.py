"""The producer: one thread per started request, running the backend into its channel.

Generation never runs on the event loop. :func:`start_producer` starts the
request's thread, which calls :meth:`Backend.generate` with the request's
:class:`~wsserver.channel.Channel` as the sink, and reports back to the loop
only through ``call_soon_threadsafe``:

* a normal end is queued in the channel (``End``) behind the last text, so the
  sender sends it in order;
* a cancel (``GenerationCancelled``) ends the thread quietly — the client has
  had its ``done`` already;
* a stall, or a failure that cannot be queued because the channel is full or
  closed, goes to ``on_failed`` on the loop;
* in every case ``gen.exited`` is resolved once the thread is done with the
  model, and ``on_exit`` runs on the loop (it frees the model slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .backends.base import Backend, GenerationRequest
from .channel import Channel
from .errors import BackendError, GenerationCancelled, GenerationStalled
from .protocol import Generate
from .session import Outcome

__all__ = ["Generation", "start_producer"]

log = logging.getLogger("wsserver.producer")


@dataclass(eq=False)
class Generation:
    """The live parts of one started request."""

    request: Generate
    channel: Channel
    task: asyncio.Task[None] | None = None
    acquire: asyncio.Task[int] | None = None
    thread: threading.Thread | None = None
    exited: asyncio.Future[None] | None = None
    stopped: bool = False
    slot: int | None = None
    #: Loop time at which a cancel (or restart) frame stopped this request.
    cancel_requested: float | None = None
    #: Loop time at which the server began handling the request (for log timings).
    created: float = 0.0
    #: Loop time at which the producer thread of a cancelled request exited.
    exited_at: float | None = None

    def stop(self) -> None:
        """Cancel: wake and end the producer, stop waiting for a slot. Idempotent."""
        self.stopped = True
        self.channel.close()
        if self.acquire is not None and not self.acquire.done():
            self.acquire.cancel()


def start_producer(
    gen: Generation,
    backend: Backend,
    request: GenerationRequest,
    *,
    loop: asyncio.AbstractEventLoop,
    on_failed: Callable[[Generation, Outcome], None],
    on_exit: Callable[[], None],
    name: str,
    log_context: Mapping[str, Any],
) -> None:
    """Start ``gen``'s producer thread; see the module docstring for what it reports."""
    assert gen.slot is not None
    slot = gen.slot
    channel = gen.channel
    exited: asyncio.Future[None] = loop.create_future()
    exited.add_done_callback(lambda _: on_exit())
    gen.exited = exited

    def produce() -> None:
        try:
            outcome = backend.generate(request, slot=slot, sink=channel, cancel=channel.cancel)
            channel.end(outcome)
        except GenerationCancelled:
            pass
        except GenerationStalled:
            stalled = Outcome(
                reason="error",
                completion_tokens=channel.tokens,
                error_code="stalled",
                error_message="the client did not read for the stall timeout",
            )
            _call_soon(loop, on_failed, gen, stalled)
        except Exception as exc:
            if not isinstance(exc, BackendError):
                # Unexpected: log the traceback here; the client only gets "internal".
                log.exception("id=%s backend failed", request.id, extra=dict(log_context))
            known = exc if isinstance(exc, BackendError) else None
            failed = Outcome(
                reason="error",
                completion_tokens=channel.tokens,
                error_code=known.code if known else "internal",
                error_message=str(known) if known else "the backend failed",
            )
            try:
                channel.end(failed)
            except (GenerationCancelled, GenerationStalled):
                _call_soon(loop, on_failed, gen, failed)
        finally:
            _call_soon(loop, _set_result, exited)

    gen.thread = threading.Thread(target=produce, name=name, daemon=True)
    gen.thread.start()


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    # The loop may already be closed at interpreter shutdown; nothing to tell then.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)

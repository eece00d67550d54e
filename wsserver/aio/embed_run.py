"""One embedding (or rerank) request's engine side: acquire → prepare → embed → release.

The same way in as a generation (:mod:`wsserver.aio.pipeline`), without
the stream: the request waits in its model's queue for a slot
(:meth:`~wsserver.aio.models.ModelPool.acquire`: the model is loaded on
demand, connections take turns, ``overloaded`` past ``max_waiting``); its
inputs are tokenized and checked on a worker thread
(the model's embedding door, :mod:`wsserver.backends.embed_door`: off the
loop and off the engine's thread, which serves every stream); the engine
gets it through the same door and completes it within its steps; a model
whose engine embeds nothing is refused by name. The slot is released when the engine completes the request — never
before, so a model never runs more than its slots, also after a cancel.

:meth:`EmbedRun.cancel` (the client gone, the server's shutdown) leaves the
queue at once, or sets the request's cancel event, which ends it in the
engine within one step; :meth:`EmbedRun.run` then returns ``None``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

from ..backends.base import CancelEvent
from ..backends.embed_door import EmbedSubmission
from ..core.embedding import Embed, Embedded
from ..core.protocol import Progress
from ..errors import ProtocolError
from .models import Model
from .services import Services

__all__ = ["EmbedRun"]


class EmbedRun:
    """One embedding request on its model (see the module docstring)."""

    def __init__(self, services: Services, model: Model, request: Embed) -> None:
        self._services = services
        self._model = model
        self.request = request
        self._event = CancelEvent()
        self._acquire: asyncio.Future[int] | None = None
        #: When the request started (its durations are from here).
        self._started = time.monotonic()
        #: The engine's handle, once submitted.
        self.submission: EmbedSubmission | None = None

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        """Stop the request: out of the queue, or out of the engine within a step."""
        self._event.set()
        if self._acquire is not None and not self._acquire.done():
            self._acquire.cancel()

    async def run(self) -> Embedded | None:
        """The request's result; ``None`` once cancelled. Raises
        :class:`~wsserver.errors.ProtocolError`: refused (the queue, the
        model's load, the inputs) or failed in the engine. Counted in
        ``wsserver_embedding_requests_total`` by how it ended."""
        reason = "error"
        try:
            result = await self._run()
            reason = "cancelled" if result is None else "complete"
            return result
        except asyncio.CancelledError:
            reason = "cancelled"
            raise
        finally:
            seconds = time.monotonic() - self._started
            self._services.metrics.embedded(self.request.kind, reason, seconds)

    async def _run(self) -> Embedded | None:
        services, model, request = self._services, self._model, self.request
        if self.cancelled:
            return None  # gone before it could queue
        self._acquire = asyncio.ensure_future(
            services.models.acquire(model, request.id, _not_told, owner=request.conn_id)
        )
        try:
            slot = await self._acquire
        except asyncio.CancelledError:
            if self.cancelled:
                return None
            raise
        queued_ms = (time.monotonic() - self._started) * 1000.0
        loop = asyncio.get_running_loop()
        released = False
        services.embed_slots[self] = (model.name, slot)
        try:
            if self.cancelled:
                return None
            door = model.backend.embeddings()
            if door is None:
                what = "rerank is" if request.kind == "rerank" else "embeddings are"
                raise ProtocolError(
                    "unsupported_option",
                    f"{what} not served by this model's engine ({model.name})",
                    request.id,
                )
            prepared = await asyncio.to_thread(door.prepare, request)
            if self.cancelled:
                return None
            submission = self.submission = door.start(prepared, cancel=self._event)
            finished: asyncio.Future[None] = loop.create_future()
            # The slot goes back when the engine is done with the request, not before.
            released = True
            submission.add_done_callback(lambda: _call_soon(loop, self._release, slot, finished))
            await asyncio.shield(finished)
        finally:
            if not released:
                services.embed_slots.pop(self, None)
                services.models.release(model, slot, request.keep_alive)
        if submission.error is not None:
            code, message = submission.error
            raise ProtocolError(code, message, request.id)
        result = submission.result
        if self.cancelled or result is None:
            return None
        total_ms = (time.monotonic() - self._started) * 1000.0
        return dataclasses.replace(result, queued_ms=queued_ms, total_ms=total_ms)

    def _release(self, slot: int, finished: asyncio.Future[None]) -> None:
        self._services.embed_slots.pop(self, None)
        self._services.models.release(self._model, slot, self.request.keep_alive)
        if not finished.done():
            finished.set_result(None)


def _not_told(position: int, loading: bool, download: Progress | None) -> None:
    """A whole answer has nothing to say while it waits (its queue position)."""


def _call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    # The loop may already be closed at interpreter shutdown; nothing to tell then.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)

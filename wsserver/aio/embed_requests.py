"""A WebSocket connection's ``embed`` requests, on the loop (docs/embeddings.md).

An ``embed`` is not a generation: no session row, no stream. Like a ``pull``
(:mod:`wsserver.aio.pull_requests`) it runs beside the connection's
generations and shares their ids; its engine side is an
:class:`~wsserver.aio.embed_run.EmbedRun` — the model's queue and engine, as
``POST /v1/embeddings`` has them — and it ends with exactly one
``embed_done``:

* ``complete`` with the vectors (float lists or base64), the model and the
  tokens read; ``error`` with a wire code (a refusal the engine made after
  the request was accepted: an input over the model's length, a token
  outside its vocabulary, a model that cannot embed);
* ``cancelled`` at once on the client's ``cancel`` — the engine lets the
  request go within a step. A lost connection cancels every embed.

A frame refused before it is accepted (a used id, an unknown model, more
than :data:`MAX_EMBEDS` running on the connection) is an ``error`` frame, as
a ``generate``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Final

from websockets.exceptions import ConnectionClosed

from ..core.embedding import Embed
from ..core.protocol import EmbedDone, EmbedFrame, Error, ServerFrame
from ..errors import CONTEXT_LENGTH_EXCEEDED, ProtocolError
from ..logs import ConnectionLog
from .embed_run import EmbedRun
from .services import Services
from .side_requests import SideRequests

__all__ = ["MAX_EMBEDS", "ConnectionEmbeds"]

#: Embeds running at once on one connection (each may hold up to 64 MiB of
#: vectors until written); more are refused with ``busy``.
MAX_EMBEDS: Final = 4


class ConnectionEmbeds(SideRequests[tuple[EmbedRun, "asyncio.Task[None]"]]):
    """Serves one connection's ``embed`` requests (see the module docstring)."""

    def __init__(
        self,
        services: Services,
        *,
        write: Callable[[ServerFrame], Awaitable[None]],
        log: ConnectionLog,
        id_taken: Callable[[str], bool],
    ) -> None:
        super().__init__(id_taken)
        self._services = services
        self._write = write
        self._log = log

    async def receive(self, frame: EmbedFrame) -> None:
        try:
            self.check_new(
                frame.id,
                MAX_EMBEDS,
                f"{MAX_EMBEDS} embeds already run on this connection: wait for one to end",
            )
            model, name = self._services.models.lookup(frame.model, frame.id)
        except ProtocolError as exc:
            self._log.request(frame.id).info(
                "refused: %s %s", exc.code, exc.message, extra={"code": exc.code}
            )
            self._services.metrics.errors.labels(exc.code).inc()
            await self._write_safely(Error(id=exc.request_id, code=exc.code, message=exc.message))
            return
        self._used.add(frame.id)
        request = Embed(id=frame.id, inputs=frame.inputs, model=name, conn_id=self._log.conn_id)
        run = EmbedRun(self._services, model, request)
        task = asyncio.create_task(
            self._finish(frame, run, name), name=f"embed-{self._log.conn_id}-{frame.id}"
        )
        self._running[frame.id] = (run, task)

    async def cancel(self, request_id: str) -> None:
        """The client's ``cancel`` of a running embed: its ``embed_done`` at once."""
        entry = self._running.pop(request_id, None)
        if entry is None:
            return
        entry[0].cancel()
        self._log.request(request_id).info("embed cancelled")
        await self._write_safely(EmbedDone(id=request_id, reason="cancelled"))

    async def close(self) -> None:
        """The connection is gone: every embed is cancelled, its engine let go."""
        running, self._running = self._running, {}
        for run, _ in running.values():
            run.cancel()
        for _, task in running.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _finish(self, frame: EmbedFrame, run: EmbedRun, name: str) -> None:
        request_id = frame.id
        try:
            result = await run.run()
        except ProtocolError as exc:
            code = exc.code
            message = exc.message
            if exc.detail == CONTEXT_LENGTH_EXCEEDED:
                code = "too_large"
            done = EmbedDone(id=request_id, reason="error", error_code=code, error_message=message)
            self._log.request(request_id).info("embed failed: %s %s", code, message)
            self._services.metrics.errors.labels(code).inc()
        except Exception:
            self._log.request(request_id).exception("embed failed")
            done = EmbedDone(
                id=request_id,
                reason="error",
                error_code="internal",
                error_message="the embedding failed",
            )
        else:
            if result is None:
                return  # cancelled: its embed_done went out with the cancel
            done = EmbedDone(
                id=request_id,
                reason="complete",
                model=name,
                vectors=result.vectors,
                encoding=frame.encoding,
                prompt_tokens=result.prompt_tokens,
            )
            self._log.request(request_id).info(
                "embedded %d input(s), %d token(s)", len(result.vectors), result.prompt_tokens
            )
        if self._running.pop(request_id, None) is not None:
            await self._write_safely(done)

    async def _write_safely(self, frame: ServerFrame) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._write(frame)

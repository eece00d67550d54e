"""A WebSocket connection's ``pull`` requests, on the loop.

The state is :class:`wsserver.pull.requests.PullRequests` (sans-I/O); here
each accepted pull joins the server's download of its reference
(:class:`~wsserver.aio.pulls.Pulls`: a second pull of it, a model loading
from it, share one download), writes its progress, and at the end adds the
model to the registry (:meth:`~wsserver.aio.models.ModelPool.add_pulled`)
and writes its one ``pull_done``.

* **Progress** goes out as the download reports it (at once on a new status
  or file, else a couple of times a second), one frame in flight per pull:
  a report that comes while the last one is still being written replaces the
  one waiting, so a slow reader gets the latest, not a backlog.
* **Cancel** answers at once (``pull_done`` cancelled) and leaves the
  download, which stops if nobody else waits for it (its partial file stays
  for a resume). A lost connection leaves all of its pulls the same way.

Who may pull is decided once, for the connection (:func:`pull_refusal`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from websockets.exceptions import ConnectionClosed

from ..config import MODEL_NAME_RE, Config
from ..core.protocol import Error, Pull, ServerFrame
from ..errors import ProtocolError, PullError
from ..logs import ConnectionLog
from ..pull.hub import PullCancelled
from ..pull.progress import Progress
from ..pull.requests import PullRequests
from .pulls import Subscription
from .services import Services

__all__ = ["ConnectionPulls", "pull_refusal"]


def pull_refusal(config: Config) -> str | None:
    """Why this server's API clients may not pull, or ``None`` if they may."""
    if not config.models.allow_pull:
        return (
            "pulling models is not enabled on this server (the operator sets "
            "models.allow_pull, with security.auth_token; or pulls on the server's "
            "machine: wsserver pull REFERENCE)"
        )
    if config.backend.kind != "llama":
        return f"this server's backend ({config.backend.kind}) serves no GGUF files"
    return None


class _Running:
    __slots__ = ("idle", "pending", "sending", "subscription", "task")

    def __init__(self, subscription: Subscription) -> None:
        self.subscription = subscription
        self.task: asyncio.Task[None] | None = None
        self.sending = False
        self.pending: Progress | None = None
        #: Set while no progress frame is being sent (nor waits to be).
        self.idle = asyncio.Event()
        self.idle.set()


class ConnectionPulls:
    """Serves one connection's pulls (see the module docstring)."""

    def __init__(
        self,
        services: Services,
        *,
        write: Callable[[ServerFrame], Awaitable[None]],
        log: ConnectionLog,
        id_taken: Callable[[str], bool],
    ) -> None:
        self._services = services
        self._write = write
        self._log = log
        self._id_taken = id_taken
        self.book = PullRequests()
        #: ``None`` if this connection may pull, else why not (its ``error``).
        self.refusal = (
            pull_refusal(services.config) if services.pulls is not None else "no pulls here"
        )
        self._running: dict[str, _Running] = {}
        self._closed = False

    @property
    def allowed(self) -> bool:
        return self.refusal is None

    def __len__(self) -> int:
        return len(self._running)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` is a running pull (a ``cancel`` of it is ours)."""
        return self.book.is_running(request_id)

    def knows(self, request_id: str) -> bool:
        """Whether a pull used ``request_id`` (a generation may not)."""
        return self.book.knows(request_id)

    async def receive(self, frame: Pull) -> None:
        try:
            self.book.accept(frame, allowed=self.refusal, id_taken=self._id_taken(frame.id))
            if not MODEL_NAME_RE.fullmatch(frame.model.name):
                self.book.cancel(frame.id)
                raise ProtocolError(
                    "bad_reference",
                    f"{frame.model.name[:140]!r} cannot be a model's name (at most 128 "
                    "characters of A-Z a-z 0-9 . _ : + / -): pull it with wsserver pull and "
                    "name it in the configuration",
                    frame.id,
                )
        except ProtocolError as exc:
            self._log.request(frame.id).info(
                "refused: %s %s", exc.code, exc.message, extra={"code": exc.code}
            )
            self._services.metrics.errors.labels(exc.code).inc()
            await self._write_safely(Error(id=exc.request_id, code=exc.code, message=exc.message))
            return
        pulls = self._services.pulls
        assert pulls is not None
        self._log.request(frame.id).info("pull %s", frame.model.text)
        running = _Running(pulls.start(frame.model))
        self._running[frame.id] = running
        running.subscription.on_progress = lambda progress: self._progressed(frame.id, progress)
        running.task = asyncio.create_task(
            self._finish(frame, running), name=f"pull-{self._log.conn_id}-{frame.id}"
        )

    async def cancel(self, request_id: str) -> None:
        """The client's ``cancel`` of a running pull: its ``pull_done`` at once."""
        done = self.book.cancel(request_id)
        running = self._running.pop(request_id, None)
        if running is not None:
            running.subscription.leave()
            if running.task is not None:
                running.task.cancel()
        if done is not None:
            self._log.request(request_id).info("pull cancelled")
            await self._write_safely(done)

    async def close(self) -> None:
        """The connection is gone: every pull leaves its download."""
        self._closed = True
        for request_id in list(self._running):
            self.book.cancel(request_id)
            running = self._running.pop(request_id)
            running.subscription.leave()
            if running.task is not None:
                running.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running.task

    # ------------------------------------------------------------ one pull

    def _progressed(self, request_id: str, progress: Progress) -> None:
        running = self._running.get(request_id)
        if running is None or self._closed:
            return
        if running.sending:
            running.pending = progress  # the latest replaces the one waiting
            return
        running.sending = True
        running.idle.clear()
        self._services.in_background(self._send_progress(request_id, running, progress))

    async def _send_progress(self, request_id: str, running: _Running, progress: Progress) -> None:
        try:
            next_progress: Progress | None = progress
            while next_progress is not None:
                # Checked at the last moment, with no await before the write
                # starts: no progress frame follows the pull's pull_done.
                frame = self.book.progress(request_id, next_progress)
                if frame is None:
                    return
                running.pending = None
                with contextlib.suppress(ConnectionClosed):
                    await self._write(frame)
                next_progress = running.pending
        finally:
            running.sending = False
            running.idle.set()

    async def _finish(self, frame: Pull, running: _Running) -> None:
        request_id = frame.id
        try:
            pulled = await running.subscription.wait()
            # Its last progress (``done``) goes out before its pull_done: the
            # latest report waiting behind a slow send is not dropped.
            await running.idle.wait()
        except PullError as exc:
            done = self.book.fail(request_id, exc.code, exc.message)
            if done is not None:
                self._log.request(request_id).info("pull failed: %s %s", exc.code, exc.message)
                self._services.metrics.errors.labels(exc.code).inc()
        except PullCancelled:
            # The server is stopping (a cancel by this client already answered).
            done = self.book.cancel(request_id)
        else:
            model = self._services.models.add_pulled(self._services.config, pulled)
            done = self.book.complete(request_id, model.info(), pulled.downloaded)
            if done is not None:
                self._log.request(request_id).info(
                    "pulled %s as model %s (%d bytes downloaded)",
                    frame.model.text,
                    model.name,
                    pulled.downloaded,
                )
        self._running.pop(request_id, None)
        if done is not None:
            await self._write_safely(done)

    async def _write_safely(self, frame: ServerFrame) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._write(frame)

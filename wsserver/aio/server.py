"""The asyncio server: listening socket, handshake, lifecycle, shutdown.

It owns the backend, the scheduler that shares the backend's slots, the
metrics and the set of live connections, and hands each piece of the asyncio
layer only what that piece uses: the :class:`~wsserver.aio.services.Services`
that every request uses to both dialects (WebSocket connections, and the
OpenAI API's :class:`~wsserver.aio.openai_http.HttpApi`), an
:class:`~wsserver.aio.http.HttpContext` to the plain HTTP answers, callables
to the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import signal
import threading
import time
from typing import Any, cast

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve

from .. import __version__
from ..backends import Backend, ModelEntry, create_models, default_aliases
from ..config import Config
from ..core.protocol import Limits
from ..dialects.responses.store import ResponseStore
from ..logs import ConnectionLog
from ..pull.hub import Hub, HubSettings
from ..security import ConnectionLimiter, Gatekeeper, exposure_warning
from .connection import ProtocolDialect
from .front import front_factory
from .http import HttpContext, plain_answer, process_request
from .http_router import Router, api_routes
from .listener import make_listening_socket, select_ws_subprotocol
from .metrics import Metrics, ModelCollector, Snapshot
from .models import ModelPool
from .openai_gate import Gate, RateLimiter
from .openai_http import HttpApi, HttpConnection
from .peer import peer_aware_connection
from .pipeline import Generation
from .pulls import Pulls
from .responses_http import ResponsesRoute
from .responses_socket import PATH as RESPONSES_SOCKET
from .responses_socket import ResponsesDialect
from .resume import Resumes
from .services import Services
from .socket_connection import SocketConnection, SocketDialectFactory
from .upstream_metrics import UpstreamCollector
from .web import web_routes

__all__ = ["Server", "run"]

log = logging.getLogger("wsserver.server")

#: A slot held by no live request for this long means the scheduler's books
#: do not balance (a leak): /readyz says so and the log has an error.
ORPHAN_GRACE_S = 1.0

#: At shutdown, how long connections get for their last frames and closing
#: handshake once the grace period is over (then they are aborted).
_FAREWELL_S = 0.4


class Server:
    """A wsserver instance. ``await start()``, then ``await stop()``."""

    def __init__(
        self, config: Config, backend: Backend | None = None, *, hub: Hub | None = None
    ) -> None:
        self.config = config
        entries = (
            [ModelEntry(backend.model_name, backend, aliases=default_aliases(config))]
            if backend is not None
            else create_models(config)
        )
        #: Downloads from the Hugging Face Hub, one per reference (docs/models.md).
        self.pulls = Pulls(hub or Hub(HubSettings.from_config(config.models)))
        #: Every model served (docs/operations.md, "Several models"); the default first.
        self.models = ModelPool(
            entries, budget=config.backend.llama.models_memory_bytes, pulls=self.pulls
        )
        #: The default model's engine and queue.
        self.backend = self.models.default.backend
        self.server_name = f"wsserver/{__version__}"
        limits = config.limits
        #: What a connection may ask for, as ``hello`` tells the client
        #: (``config.limits`` is the configuration section it comes from).
        self.wire_limits = Limits(
            max_frame_bytes=config.server.max_frame_bytes,
            max_prompt_chars=limits.max_prompt_chars,
            max_messages=limits.max_messages,
            max_tokens=limits.max_tokens,
            default_max_tokens=limits.default_max_tokens,
            max_upload_bytes=limits.max_upload_bytes,
        )
        self.scheduler = self.models.default.scheduler
        #: Every WebSocket connection, whatever its dialect.
        self.connections: dict[str, SocketConnection] = {}
        self.background: set[asyncio.Task[Any]] = set()
        self.ready = asyncio.Event()
        self._ids = itertools.count(1)
        self._ws_server: WsServer | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._stopping = False
        #: Slots held by no live request, with the loop time each was first seen so.
        self._orphans: dict[tuple[str, int], float] = {}
        self.gatekeeper = Gatekeeper(config)
        self.connection_limiter = ConnectionLimiter(
            max_total=limits.max_connections, max_per_ip=limits.max_connections_per_ip
        )
        self.metrics = Metrics(
            backend_kind=config.backend.kind,
            model_name=self.backend.model_name,
            scheduler=self.models,
            snapshot=self.snapshot,
            orphaned_slots=self.orphaned_slots,
            loop_probe_ms=config.server.loop_probe_ms,
            queue_log_s=config.server.queue_log_s,
            check_engines=self.models.check_engines,
        )
        self.metrics.registry.register(UpstreamCollector(self.backend.upstream_stats))
        self.metrics.registry.register(ModelCollector(self.models.stats))
        #: Resumable requests, attached or detached (docs/protocol.md, "Resuming a stream").
        stream = config.stream
        self.resumes = Resumes(
            grace_s=stream.resume_grace_s,
            stall_s=stream.stall_timeout_s,
            waiting=lambda: self.models.waiting,
            max_total=stream.max_detached,
            max_per_client=stream.max_detached_per_client,
        )
        self._services = Services(
            config=config,
            backend=self.backend,
            scheduler=self.scheduler,
            models=self.models,
            metrics=self.metrics,
            wire_limits=self.wire_limits,
            server_name=self.server_name,
            background=self.background,
            pulls=self.pulls,
        )
        #: Plain HTTP on the WebSocket port; ``http.routes`` holds the extra routes.
        self.http = HttpContext(
            gatekeeper=self.gatekeeper,
            connection_limiter=self.connection_limiter,
            metrics=self.metrics,
            is_ready=self.ready.is_set,
            orphaned_slots=self.orphaned_slots,
            engine_unready=self.models.unready_reason,
            routes=web_routes(),
        )
        #: The WebSocket dialects by the path of the upgrade: the Responses
        #: API's WebSocket mode, and on any other path the WebSocket protocol.
        self._socket_dialects: dict[str, SocketDialectFactory] = {
            RESPONSES_SOCKET: ResponsesDialect
        }
        self._protocol_dialect = functools.partial(ProtocolDialect, resumes=self.resumes)
        #: The Responses API over HTTP, and the responses it keeps (docs/responses-api.md).
        self.responses = ResponsesRoute(
            self._services,
            ResponseStore(
                max_bytes=limits.responses_store_bytes, ttl_s=limits.responses_store_ttl_s
            ),
        )
        #: The HTTP API on the same port (wsserver.aio.front routes to it); its
        #: routes are registered in one place, wsserver.aio.http_router.api_routes.
        gate = Gate(
            gatekeeper=self.gatekeeper,
            connection_limiter=self.connection_limiter,
            rate_limiter=RateLimiter(rate=limits.frames_per_s, burst=limits.frames_burst),
            metrics=self.metrics,
        )
        router = Router(
            self._services,
            gate,
            api_routes(self._services, self.responses),
            plain=functools.partial(plain_answer, self.http),
        )
        self.api = HttpApi(
            services=self._services, gate=gate, router=router, next_id=lambda: f"c{next(self._ids)}"
        )

    @property
    def port(self) -> int:
        assert self._ws_server is not None
        return int(self._ws_server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        assert self._ws_server is not None
        host, port = self._ws_server.sockets[0].getsockname()[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{port}/"

    async def start(self) -> None:
        """Listen, then load the model in the background."""
        server = self.config.server
        sock = make_listening_socket(server.host, server.port, sndbuf=server.sndbuf)
        http = self.http
        self._ws_server = await serve(
            self._handle,
            sock=sock,
            process_request=lambda conn, request: process_request(http, conn, request),
            max_size=server.max_frame_bytes,
            max_queue=server.max_queue,
            write_limit=server.write_limit,
            ping_interval=server.ping_interval_s or None,
            ping_timeout=server.ping_interval_s or None,
            close_timeout=server.send_timeout_s,
            server_header=self.server_name,
            select_subprotocol=select_ws_subprotocol,
            # Each client first meets the Front, which gives /v1 requests to the
            # OpenAI HTTP API and everything else to websockets' own connection.
            create_connection=cast(
                "type[ServerConnection]",
                front_factory(
                    ws_factory=peer_aware_connection(
                        output_ceiling=max(server.max_output_bytes, server.write_limit),
                        output_timeout=server.send_timeout_s,
                    ),
                    http_factory=lambda to_websockets: HttpConnection(
                        self.api, to_websockets=to_websockets
                    ),
                ),
            ),
            # Token frames are small and frequent: deflate would cost CPU on
            # every frame and ~100 KB of zlib state per connection.
            compression=None,
        )
        log.info(
            "wsserver %s listening on %s (backend %s)",
            __version__,
            self.url,
            self.config.backend.kind,
        )
        warning = exposure_warning(self.config)
        if warning is not None:
            log.warning("%s", warning)
        self.metrics.start()
        self._load_task = asyncio.create_task(self._load())

    async def _load(self) -> None:
        log.info("loading model %s", self.backend.model_name)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.models.start()
        except Exception as exc:
            log.error("model failed to load: %s", exc)
            raise
        self.metrics.set_model(self.backend.model_name)
        self.backend.on_model = self.metrics.set_model
        self.ready.set()
        log.info(
            "ready: model %s loaded in %.1fs; serving %s",
            self.backend.model_name,
            loop.time() - started,
            self.url,
        )

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raises if loading failed."""
        assert self._load_task is not None
        await asyncio.shield(self._load_task)

    async def _handle(self, websocket: ServerConnection) -> None:
        path = websocket.request.path.split("?", 1)[0] if websocket.request is not None else "/"
        dialect = self._socket_dialects.get(path, self._protocol_dialect)
        conn_id = f"c{next(self._ids)}"
        connection = SocketConnection(self._services, websocket, conn_id, dialect=dialect)
        self.connections[conn_id] = connection
        self.metrics.connections_total.inc()
        peer = websocket.remote_address
        conn_log = ConnectionLog(log, conn_id)
        conn_log.info("open from %s%s", peer[0] if peer else "?", connection.dialect.label)
        try:
            await connection.run()
        finally:
            del self.connections[conn_id]
            self.connection_limiter.release(websocket)
            self.metrics.connection_closed(websocket.protocol)
            conn_log.info("closed (code %s)", websocket.close_code)

    def orphaned_slots(self, now: float | None = None) -> list[str]:
        """Slots the scheduler counts as held that no live request holds, for
        longer than :data:`ORPHAN_GRACE_S`.

        The last line of defence, not a fix: every acquire, cancel and release
        interleaving is meant to keep the books (see the scheduler). A slot is
        between owners for at most a loop turn (handed over, its task not yet
        resumed), so only one that stays orphaned is reported. Called by the
        periodic probe and by ``/readyz``. Each is named ``model:slot`` (every
        model's queue numbers its slots from 0).
        """
        now = asyncio.get_running_loop().time() if now is None else now
        owned = {(g.model.name, g.slot) for g in self._generations() if g.slot is not None}
        owned |= set(self._services.embed_slots.values())
        held = {(m.name, slot) for m in self.models.models.values() for slot in m.scheduler.held()}
        orphans = held - owned
        for slot in list(self._orphans):
            if slot not in orphans:
                del self._orphans[slot]
        newly = []
        for slot in orphans:
            since = self._orphans.setdefault(slot, now)
            if now - since >= ORPHAN_GRACE_S:
                newly.append(slot)
        return [f"{name}:{slot}" for name, slot in sorted(newly)]

    def _generations(self) -> list[Generation]:
        """Every live request: over WebSocket connections and HTTP ones, and
        the detached ones (resumable requests whose connection was lost)."""
        tables = [c.generations for c in list(self.connections.values())]
        tables += [h.generations for h in list(self.api.live.values())]
        return [g for table in tables for g in list(table.values())] + self.resumes.detached()

    def producer_threads(self) -> int:
        """Requests whose engine still runs, across all connections: live
        producer threads for a threaded engine (tests, bench, the metric)."""
        return self.snapshot().producers_alive

    def snapshot(self) -> Snapshot:
        """The live state the metrics read at scrape time."""
        connections = list(self.connections.values())
        generations = self._generations()
        now = time.monotonic()
        blocked_seconds = 0.0
        for generation in generations:
            channel = generation.channel
            blocked_seconds += channel.blocked_seconds
            since = channel.blocked_since
            if since is not None:
                blocked_seconds += max(0.0, now - since)
        http = list(self.api.live.values())
        return Snapshot(
            connections=len(connections),
            buffered=[c.buffered_bytes() for c in connections] + [h.buffered_bytes() for h in http],
            producers_alive=sum(1 for g in generations if g.alive()),
            producers_blocked=sum(1 for g in generations if g.channel.blocked_since is not None),
            blocked_seconds=blocked_seconds,
        )

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting; give running requests ``grace`` seconds; end the rest
        as ``cancelled``; close every connection with 1001."""
        if self._stopping:
            return
        self._stopping = True
        grace = self.config.server.shutdown_grace_s if grace is None else grace
        assert self._ws_server is not None
        ws_server = self._ws_server
        ws_server.close(close_connections=False)
        log.info("stopping: %d connection(s), grace %.1fs", len(self.connections), grace)
        running = [g.task for g in self._generations() if g.task is not None]
        if running and grace > 0:
            # asyncio.wait, not gather: a timeout must not cancel the requests.
            await asyncio.wait(running, timeout=grace)
        # Detached requests have nobody to say farewell to: end them now.
        detached = [g.task for g in self.resumes.close() if g.task is not None]
        if detached:
            await asyncio.gather(*detached, return_exceptions=True)
        # The farewell (done cancelled, close 1001) is bounded: a client that
        # does not read is aborted rather than allowed to hold up the exit.
        https = list(self.api.live.values())
        for http in https:
            http.shutdown()
        await asyncio.gather(
            *(c.shutdown(timeout=_FAREWELL_S) for c in list(self.connections.values())),
            self._http_gone(https),
            return_exceptions=True,
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_FAREWELL_S):
                await ws_server.wait_closed()
        await self.metrics.stop()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        self.pulls.close()
        await self.models.close()
        log.info("stopped")

    @staticmethod
    async def _http_gone(https: list[HttpConnection]) -> None:
        """Wait until the HTTP connections' engines are gone (their requests
        were cancelled by ``shutdown``; a request a client left just before
        is winding down too) and, within the farewell, the connections closed."""
        tasks = [g.task for h in https for g in list(h.generations.values()) if g.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_FAREWELL_S):
                await asyncio.gather(*(h.closed.wait() for h in https))
        for http in https:
            http.abort()


async def run(config: Config, *, backend: Backend | None = None) -> int:
    """Serve until SIGINT or SIGTERM; a second signal exits at once.

    The process exits within ``server.shutdown_grace_s`` +
    ``server.shutdown_timeout_s`` of the first signal whatever the engines do:
    a watchdog thread exits it hard (status 1, logged) past that, and a
    shutdown that ends with an engine's thread still stuck in native code
    exits hard at once (Python's own exit would free the model under it).
    """
    server = Server(config, backend)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0
    watchdog: threading.Timer | None = None

    def on_signal(signum: int) -> None:
        nonlocal signals, watchdog
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("received %s", signal.Signals(signum).name)
        bound = config.server.shutdown_grace_s + config.server.shutdown_timeout_s
        watchdog = threading.Timer(bound, _shutdown_overdue, (bound,))
        watchdog.daemon = True
        watchdog.start()
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.start()
    load = server._load_task
    assert load is not None
    stop_wait = asyncio.create_task(stop.wait())
    await asyncio.wait({stop_wait, load}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        stop_wait.cancel()
        await server.stop(grace=0)
        return 1
    await stop_wait
    await server.stop()
    stuck = _stuck_engine_threads()
    if stuck:
        _exit_hard(f"engine thread(s) still inside native calls: {', '.join(stuck)}")
    if watchdog is not None:
        watchdog.cancel()
    return 0


def _stuck_engine_threads() -> list[str]:
    """The llama engines' threads that may be inside a native call: a step
    loop (alive after its engine was closed, stuck), or a grammar call given up on."""
    return [
        t.name
        for t in threading.enumerate()
        if t.is_alive()
        and (t.name.startswith("wsserver-llama-engine") or t.name.endswith("-abandoned"))
    ]


def _shutdown_overdue(bound: float) -> None:
    stuck = _stuck_engine_threads()
    _exit_hard(
        f"the shutdown did not end within {bound:g}s (server.shutdown_grace_s + "
        f"server.shutdown_timeout_s){'; still running: ' + ', '.join(stuck) if stuck else ''}"
    )


def _exit_hard(why: str) -> None:
    """Exit now, status 1: no interpreter shutdown (it would free native
    memory that a stuck thread still uses, or wait for it)."""
    log.error("%s: exiting now, with status 1", why)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(1)

"""The model registry: one engine per loaded model, loaded on demand.

Theory of operation
-------------------
Each model the server serves is a :class:`Model`: its backend (for llama, a
:class:`~wsserver.backends.llama.LlamaBackend` with its own context, batch,
queue and prefix cache) and its own :class:`~wsserver.aio.scheduler.Scheduler`
(the queue of requests waiting for one of its slots, with their positions).
The scheduler is *closed* while the model is not loaded: requests for it wait
in its queue, and their ``queued`` frames say ``loading``.

A request for an unloaded model starts its load (:meth:`ModelPool.acquire`):

0. a model whose file is a Hub reference (``model = "hf:org/repo:Q4_K_M"``)
   is pulled first (:mod:`wsserver.aio.pulls`), unless its file is already
   here: its waiting requests' ``queued`` frames carry the download's
   progress. The download is *kept*: a cancelled request leaves the queue as
   always, and the download goes on (two models of one reference, or a
   client's ``pull`` of it, share it);
1. the memory it needs is estimated on a worker thread (the GGUF's size and
   its KV cache, from its header; a corrupt file fails here);
2. room is made under the budget (:func:`wsserver.core.models.plan_room`): idle
   models — loaded, nothing running or queued — are unloaded, least recently
   used first; if busy models hold the memory, the load waits until one of
   them is idle (and gives up if every request waiting for it went away);
3. the engine loads on a worker thread — never on the event loop — and the
   scheduler opens: the queued requests start in order.

A load that fails refuses exactly the requests queued for that model
(``model_load_failed``); the others' models are untouched. A model is
unloaded (its scheduler closed in the same loop turn as the decision, then
the engine freed on a worker thread) only when it is idle: for room, or after
its ``keep_alive_s`` without requests. A request that arrives while its model
is being unloaded waits and loads it again. A cancelled waiter leaves the
queue at once (the scheduler's rule).

The default model is loaded when the server starts, with every model marked
``preload``; the server is ready when they are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 - see below
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ..backends import ModelEntry, pulled_model
from ..backends.base import Liveness
from ..config import Config
from ..core.models import ModelInfo, ModelState, Resident, plan_room
from ..core.protocol import Generate, Progress
from ..errors import ModelLoadError, ProtocolError, PullError
from ..pull.hub import PullCancelled, Pulled
from ..pull.progress import PlainLines
from .pulls import Pulls
from .scheduler import Scheduler

# asyncio.to_thread's executor imports concurrent.futures.thread on first use;
# imported here, a load that starts while a connection flood holds every file
# descriptor does not fail on opening that module (tests/test_hardening.py).

__all__ = ["Model", "ModelPool", "ModelStats", "machine_budget"]

log = logging.getLogger("wsserver.models")

#: A waiter's position callback: its place in the model's queue, whether the
#: model is still loading, and how far its download is (if it downloads).
QueuedCallback = Callable[[int, bool, Progress | None], None]


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One model's figures for ``/metrics``."""

    name: str
    loaded: bool
    active: int
    queued: int
    memory_bytes: int
    loads: int
    unloads: int
    load_failures: int
    #: The engine's running step so far, whether it is stalled, and grammar
    #: calls it gave up on that still run (:class:`~wsserver.backends.base.Liveness`).
    step_seconds: float = 0.0
    stalled: bool = False
    grammar_calls_running: int = 0


def machine_budget() -> int:
    """The default memory budget: three quarters of the machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not on this platform: no bound
        return 1 << 62
    return int(total) * 3 // 4


class Model:
    """One served model: its engine, its queue and where it stands."""

    def __init__(self, spec: ModelEntry) -> None:
        self.backend = spec.backend
        #: More names requests may give for it (its configured ``aliases``).
        self.aliases = spec.aliases
        self.keep_alive_s = spec.keep_alive_s
        self.preload = spec.preload
        self.scheduler = Scheduler(spec.backend.slots, spec.backend.max_waiting, ready=False)
        #: Its Hub reference, if its file is one; what the last pull gave.
        self.reference = spec.reference
        #: Tells its engine the file a pull gave.
        self.use_file = spec.use_file
        self.pulled: Pulled | None = None
        #: While its file downloads: how far.
        self.download: Progress | None = None
        #: ``unloading`` is shown to clients as ``unloaded``.
        self.state: ModelState | str = "unloaded"
        #: The memory it holds (estimated when its load starts; 0 when unloaded).
        self.bytes = 0
        self.last_used = 0.0
        #: Loads and unloads so far (tests, logs).
        self.loads = 0
        self.unloads = 0
        self.load_failures = 0
        self.task: asyncio.Task[None] | None = None
        #: Why its last load failed (None after a good one).
        self.load_error: Exception | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        #: The keep-alive the last finished request asked for, until it is applied.
        self.request_keep_alive: float | None = None
        #: Set whenever the state changes (tests and ``wait_state`` wait on it).
        self.changed = asyncio.Event()

    @property
    def name(self) -> str:
        """Its name (an engine may learn it on loading: the openai backend's upstream model)."""
        return self.backend.model_name

    @property
    def idle(self) -> bool:
        """No running and no queued request."""
        return self.scheduler.busy == 0 and self.scheduler.waiting == 0

    def info(self) -> ModelInfo:
        state: ModelState = self.state if self.state in ("loaded", "loading") else "unloaded"
        return ModelInfo(
            name=self.name,
            state=state,
            n_ctx=getattr(self.backend, "n_ctx", None),
            parallel=self.backend.slots,
            max_waiting=self.backend.max_waiting,
            aliases=self.aliases,
            chat_template=self._chat_template() if state == "loaded" else None,
            embeddings=(self.backend.embedding() or "none") if state == "loaded" else None,
        )

    def _chat_template(self) -> bool | None:
        """Whether the loaded engine has a chat template (a llama engine's
        ``chat_template``; an engine without the notion: not said)."""
        if not hasattr(self.backend, "chat_template"):
            return None
        return getattr(self.backend, "chat_template", None) is not None

    def _set(self, state: str) -> None:
        self.state = state
        self.changed.set()
        self.changed = asyncio.Event()


class ModelPool:
    """Every model the server serves (see the module docstring)."""

    def __init__(
        self, specs: Sequence[ModelEntry], *, budget: int = 0, pulls: Pulls | None = None
    ) -> None:
        if not specs:
            raise ValueError("a server serves at least one model")
        #: The server's downloads (for models whose file is a Hub reference).
        self.pulls = pulls
        self.models: dict[str, Model] = {spec.name: Model(spec) for spec in specs}
        self.default = next(iter(self.models.values()))
        #: Each alias → its model (create_models refused any clash).
        self.aliases: dict[str, Model] = {
            alias: model for model in self.models.values() for alias in model.aliases
        }
        self.budget = budget if budget > 0 else machine_budget()
        self._room_waiters: list[asyncio.Future[None]] = []
        self._closing = False

    # ------------------------------------------------------------ lookup

    def names(self) -> list[str]:
        """Every model name a request may give, the default first."""
        names: list[str] = []
        for model in self.models.values():
            served = model.backend.served_models()
            names.extend(served if served else [model.name])
        return names

    def infos(self) -> list[ModelInfo]:
        infos: list[ModelInfo] = []
        for model in self.models.values():
            served = model.backend.served_models()
            info = model.info()
            if not served:
                infos.append(info)
                continue
            for name, available in served.items():
                state: ModelState = "loaded" if available else "unloaded"
                infos.append(dataclasses.replace(info, name=name, state=state))
        return infos

    def resolve(self, name: str | None, request_id: str | None = None) -> Model:
        """The model a request names (``None``: the default), or ``model_not_found``."""
        return self.lookup(name, request_id)[0]

    def lookup(self, name: str | None, request_id: str | None = None) -> tuple[Model, str]:
        """The model a request names and the name it is served under: its
        canonical name for an alias (``done`` and each HTTP answer say it),
        the name asked for a model an engine chooses itself (an upstream's).

        ``None`` is the default model. Any other name is strict, with one model
        as with several: one the server does not serve raises
        ``model_not_found`` (each HTTP dialect answers 404 in its own error
        shape) before anything is queued; clients that hard-code a name are
        served through ``aliases`` in the configuration."""
        if name is None:
            return self.default, self.default.name
        model = self.models.get(name) or self.aliases.get(name)
        if model is not None:
            return model, model.name
        for candidate in self.models.values():
            served = candidate.backend.served_models()
            if served is None:
                continue
            if name in served:
                return candidate, name
            if not served and len(self.models) == 1:
                # An engine that chooses among its upstreams' models and has
                # heard from none yet: it cannot tell, and refuses the request
                # itself (upstream_unavailable) rather than call the name unknown.
                return candidate, name
        if len(self.models) == 1 and name == self.default.backend.model_name:
            return self.default, name  # an engine that learnt its model's name after loading
        listed = ", ".join(repr(n) for n in self.names()[:20])
        raise ProtocolError(
            "model_not_found",
            f"model {name[:128]!r} is not served here; the models are: {listed}",
            request_id,
        )

    def for_api(self, generate: Generate, asked: str | None) -> tuple[Generate, Model]:
        """An HTTP dialect's frame with its model filled in (:meth:`lookup`):
        the name it is served under, so that the answer names it."""
        model, name = self.lookup(asked, generate.id)
        return dataclasses.replace(generate, model=name), model

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot of any model (a load included)."""
        return sum(m.scheduler.waiting for m in self.models.values())

    @property
    def busy(self) -> int:
        """Slots held across every model."""
        return sum(m.scheduler.busy for m in self.models.values())

    def stats(self) -> list[ModelStats]:
        """Each configured model's figures, for ``/metrics`` (label values
        bounded by the configuration)."""
        stats = []
        for m in self.models.values():
            live = m.backend.liveness() if m.state == "loaded" else Liveness()
            stats.append(
                ModelStats(
                    name=m.name,
                    loaded=m.state == "loaded",
                    active=m.scheduler.busy,
                    queued=m.scheduler.waiting,
                    memory_bytes=m.bytes,
                    loads=m.loads,
                    unloads=m.unloads,
                    load_failures=m.load_failures,
                    step_seconds=live.step_seconds,
                    stalled=live.stalled,
                    grammar_calls_running=live.grammar_calls_running,
                )
            )
        return stats

    def unready_reason(self) -> str | None:
        """Why an engine cannot serve now (``/readyz``): the default model's
        engine, then any other loaded one's (named), or None."""
        reason = self.default.backend.unready_reason()
        if reason:
            return reason
        for m in self.models.values():
            if m is not self.default and m.state == "loaded":
                reason = m.backend.unready_reason()
                if reason:
                    return f"model {m.name}: {reason}"
        return None

    def check_engines(self) -> None:
        """Ask every loaded engine whether it is stalled (the periodic probe:
        an engine logs a stall when asked first, so it is logged even when no
        one asks ``/readyz``)."""
        for m in self.models.values():
            if m.state == "loaded":
                m.backend.liveness()

    def add_pulled(self, config: Config, pulled: Pulled) -> Model:
        """Serve a model a client pulled, under its reference's name (loaded on
        its first request). A name already served — a configured model, or the
        same reference pulled before — is that model, untouched."""
        reference = pulled.plan.reference
        name = reference.name
        existing = self.models.get(name) or self.aliases.get(name)
        if existing is not None:
            if existing.reference == reference and existing.pulled is None:
                existing.pulled = pulled
                if existing.use_file is not None:
                    existing.use_file(pulled.model_path)
            return existing
        model = Model(pulled_model(config, reference, pulled.model_path))
        model.pulled = pulled
        self.models[name] = model
        log.info("model %s: pulled by a client, served from %s", name, pulled.model_path)
        return model

    # ------------------------------------------------------------ requests

    async def acquire(
        self, model: Model, request_id: str, on_queued: QueuedCallback, owner: Hashable = None
    ) -> int:
        """Wait for one of ``model``'s slots, loading it first if needed;
        ``owner``: the connection asking (its share: the scheduler's "Fair by owner").

        Raises ``ProtocolError``: ``overloaded`` (its queue is full) or
        ``model_load_failed``. Cancelling the wait leaves the queue at once.
        """
        self._cancel_idle_timer(model)
        if model.state == "unloaded":
            self._start_load(model)
        try:
            return await model.scheduler.acquire(
                request_id,
                lambda position: on_queued(position, model.state != "loaded", model.download),
                owner,
            )
        finally:
            self._check_idle(model)

    def release(self, model: Model, slot: int, keep_alive: float | None = None) -> None:
        """A request's engine is done with ``slot``; ``keep_alive``: the
        request's own (seconds once idle; 0 = unload at once, -1 = only for room)."""
        model.scheduler.release(slot)
        self._check_idle(model, keep_alive)

    # ------------------------------------------------------------ start and stop

    async def start(self) -> None:
        """Load the default model and the preloaded ones; raise if the default fails."""
        first = [
            self.default,
            *(m for m in self.models.values() if m.preload and m is not self.default),
        ]
        for model in first:
            if model.state == "unloaded":
                self._start_load(model)
            assert model.task is not None
            await asyncio.shield(model.task)
            if model.load_error is not None and model is self.default:
                raise model.load_error

    async def close(self) -> None:
        """Release every engine (at shutdown, after every request completed)."""
        self._closing = True
        self._wake_room()
        for model in self.models.values():
            self._cancel_idle_timer(model)
            if model.task is not None and not model.task.done():
                # A load on its thread cannot be interrupted: let it finish,
                # then free it with the others.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await model.task
            await asyncio.to_thread(model.backend.close)

    async def wait_state(self, name: str, state: str) -> None:
        """Wait until model ``name`` is in ``state`` (tests, tools)."""
        model = self.models[name]
        while model.state != state:
            await model.changed.wait()

    # ------------------------------------------------------------ loading

    def _start_load(self, model: Model) -> None:
        model._set("loading")
        model.task = asyncio.create_task(self._load(model), name=f"load-{model.name}")

    async def _load(self, model: Model) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            if model.reference is not None:
                await self._pull(model)
            need = await asyncio.to_thread(model.backend.memory_estimate)
            model.bytes = need
            while True:
                victims = plan_room(need, self.budget, self._resident(besides=model))
                if victims is not None:
                    break
                if self._closing or (
                    model.scheduler.waiting == 0 and not (model.preload or model is self.default)
                ):
                    log.info("model %s: nobody waits for it any more; not loading it", model.name)
                    model.bytes = 0
                    model._set("unloaded")
                    return
                log.info(
                    "model %s: waiting for a busy model to become idle to fit the budget",
                    model.name,
                )
                await self._wait_for_room()
            # Each victim is closed now, in the loop turn that chose it: no
            # request can be handed one of its slots after the decision.
            await asyncio.gather(*(self._unload(self.models[key], "for room") for key in victims))
            if need + sum(r.bytes for r in self._resident(besides=model)) > self.budget:
                log.warning(
                    "model %s needs about %d MB, more than the budget of %d MB: loading it anyway",
                    model.name,
                    need >> 20,
                    self.budget >> 20,
                )
            log.info("loading model %s (about %d MB)", model.name, need >> 20)
            await asyncio.to_thread(model.backend.load)
        except asyncio.CancelledError:
            model._set("unloaded")
            raise
        except Exception as exc:
            model.load_error = exc
            model.load_failures += 1
            model.bytes = 0
            model._set("unloaded")
            log.error("model %s failed to load: %s", model.name, exc)
            model.scheduler.fail(
                ProtocolError(
                    "model_load_failed", f"model {model.name!r} could not be loaded: {exc}"
                )
            )
            self._wake_room()
            return
        model.load_error = None
        model.loads += 1
        model.last_used = loop.time()
        model._set("loaded")
        log.info("model %s loaded in %.1fs", model.name, loop.time() - started)
        model.scheduler.open()
        self._check_idle(model)

    async def _pull(self, model: Model) -> None:
        """Bring a Hub model's files here, verified (its waiting requests hear
        how far); nothing to do while the last pull's file is still there."""
        reference = model.reference
        assert reference is not None
        if model.pulled is not None and model.pulled.model_path.exists():
            return
        if self.pulls is None:
            raise ModelLoadError(
                f"{reference.text} is a Hub reference, and this server pulls nothing"
            )
        subscription = self.pulls.start(reference, keep=True)
        # The operator watching the log (a first `serve --model hf:…`) sees
        # it go: a line per status change and per tenth.
        lines = PlainLines()
        loop = asyncio.get_running_loop()

        def progressed(progress: Progress) -> None:
            model.download = progress
            model.scheduler.reannounce()
            for line in lines.lines(progress, loop.time()):
                log.info("model %s: %s", model.name, line)

        subscription.on_progress = progressed
        try:
            pulled = await subscription.wait()
        except (PullError, PullCancelled) as exc:
            why = exc.message if isinstance(exc, PullError) else "the pull was stopped"
            raise ModelLoadError(f"cannot pull {reference.text}: {why}") from None
        finally:
            subscription.on_progress = None
            model.download = None
        model.pulled = pulled
        if model.use_file is not None:
            model.use_file(pulled.model_path)
        log.info(
            "model %s: %s is %s%s",
            model.name,
            reference.text,
            pulled.model_path,
            f" (projector {pulled.mmproj.name})" if pulled.mmproj is not None else "",
        )

    def _resident(self, *, besides: Model) -> list[Resident]:
        return [
            Resident(key, m.bytes, m.state == "loaded" and m.idle, m.last_used)
            for key, m in self.models.items()
            if m is not besides and m.state != "unloaded"
        ]

    async def _wait_for_room(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._room_waiters.append(future)
        await future

    def _wake_room(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    # ------------------------------------------------------------ unloading

    def _check_idle(self, model: Model, keep_alive: float | None = None) -> None:
        """After a release or a waiter's exit: an idle model may be unloaded.

        ``keep_alive`` (the last request's, if it gave one) wins over the
        model's ``keep_alive_s``: seconds, 0 = at once, -1 = only for room."""
        if keep_alive is not None:
            model.request_keep_alive = keep_alive
        if not model.idle or self._closing:
            return
        model.last_used = asyncio.get_running_loop().time()
        self._wake_room()
        wait = model.request_keep_alive
        if wait is None:
            wait = model.keep_alive_s if model.keep_alive_s > 0 else -1.0
        model.request_keep_alive = None
        if model.state == "loaded" and wait >= 0:
            self._cancel_idle_timer(model)
            model._idle_timer = asyncio.get_running_loop().call_later(
                wait, self._idle_expired, model
            )

    def _cancel_idle_timer(self, model: Model) -> None:
        if model._idle_timer is not None:
            model._idle_timer.cancel()
            model._idle_timer = None

    def _idle_expired(self, model: Model) -> None:
        model._idle_timer = None
        if model.state == "loaded" and model.idle and not self._closing:
            self._unload(model, "idle")

    def _unload(self, model: Model, why: str) -> asyncio.Task[None]:
        """Unload an idle model: its queue is closed *now*, in the loop turn
        that decided it (no slot can be handed out after), and its engine
        freed on a worker thread by the task returned."""
        assert model.state == "loaded" and model.idle
        self._cancel_idle_timer(model)
        model.scheduler.close()
        model._set("unloading")
        log.info("unloading model %s (%s)", model.name, why)
        task = asyncio.create_task(self._free(model), name=f"unload-{model.name}")
        model.task = task
        return task

    async def _free(self, model: Model) -> None:
        await asyncio.to_thread(model.backend.close)
        model.bytes = 0
        model.unloads += 1
        model._set("unloaded")
        self._wake_room()
        if model.scheduler.waiting and not self._closing:
            # Requests came while it was being unloaded: load it again.
            self._start_load(model)

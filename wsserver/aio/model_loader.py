"""Loading and unloading the registry's models, under one memory budget.

Theory of operation
-------------------
A request for an unloaded model starts its load (:meth:`ModelLoader.wanted`):

0. a model whose file is a Hub reference (``model = "hf:org/repo:Q4_K_M"``)
   is pulled first (:mod:`wsserver.aio.pulls`), unless its file is already
   here: its waiting requests' ``queued`` frames carry the download's
   progress. The download is *kept*: a cancelled request leaves the queue as
   always, and the download goes on (two models of one reference, or a
   client's ``pull`` of it, share it);
1. the memory it needs is estimated on a worker thread (the GGUF's size and
   its KV cache, from its header; a corrupt file fails here);
2. room is made under the budget (:func:`wsserver.core.models.plan_room`, the
   decision without I/O): idle models — loaded, nothing running or queued —
   are unloaded, least recently used first; if busy models hold the memory,
   the load waits until one of them is idle (and gives up if every request
   waiting for it went away);
3. the engine loads on a worker thread — never on the event loop — and the
   scheduler opens: the queued requests start in order.

A load that fails refuses exactly the requests queued for that model
(``model_load_failed``); the others' models are untouched. A model is
unloaded (its scheduler closed in the same loop turn as the decision, then
the engine freed on a worker thread) only when it is idle: for room, or when
its keep-alive runs out (:mod:`wsserver.aio.keep_alive`). A request that
arrives while its model is being unloaded waits and loads it again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 - see below
import contextlib
import logging
import os
from collections.abc import Mapping

from ..core.models import Resident, plan_room
from ..core.protocol import Progress
from ..errors import ModelLoadError, ProtocolError, PullError
from ..pull.hub import PullCancelled
from ..pull.progress import PlainLines
from .keep_alive import KeepAlive
from .model import Model
from .pulls import Pulls

# asyncio.to_thread's executor imports concurrent.futures.thread on first use;
# imported here, a load that starts while a connection flood holds every file
# descriptor does not fail on opening that module (tests/test_hardening.py).

__all__ = ["ModelLoader", "machine_budget"]

log = logging.getLogger("wsserver.models")


def machine_budget() -> int:
    """The default memory budget: three quarters of the machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not on this platform: no bound
        return 1 << 62
    return int(total) * 3 // 4


class ModelLoader:
    """Loads and unloads the registry's models (see the module docstring)."""

    def __init__(
        self,
        models: Mapping[str, Model],
        default: Model,
        *,
        budget: int = 0,
        pulls: Pulls | None = None,
    ) -> None:
        #: The registry's models by name (read here; the registry adds to it).
        self._models = models
        #: Loaded even when no request waits for it (as the preloaded ones).
        self._default = default
        self.budget = budget if budget > 0 else machine_budget()
        #: The server's downloads (for models whose file is a Hub reference).
        self.pulls = pulls
        self._room_waiters: list[asyncio.Future[None]] = []
        self._closing = False
        self._keep_alive = KeepAlive(expire=lambda model: self.unload(model, "idle"))

    def wanted(self, model: Model) -> None:
        """A request wants ``model``: its keep-alive stops, and it loads if it is unloaded."""
        self._keep_alive.cancel(model)
        if model.state == "unloaded":
            self.load(model)

    def load(self, model: Model) -> None:
        """Start loading an unloaded ``model`` (its task: :attr:`Model.task`)."""
        model.set_state("loading")
        model.task = asyncio.create_task(self._load(model), name=f"load-{model.name}")

    def check_idle(self, model: Model, keep_alive: float | None = None) -> None:
        """After a release or a waiter's exit: an idle model may be unloaded.

        ``keep_alive`` (the last request's, if it gave one) wins over the
        model's ``keep_alive_s``: seconds, 0 = at once, -1 = only for room."""
        if keep_alive is not None:
            self._keep_alive.ask(model, keep_alive)
        if not model.idle or self._closing:
            return
        model.last_used = asyncio.get_running_loop().time()
        self._wake_room()
        self._keep_alive.start(model)

    def unload(self, model: Model, why: str) -> asyncio.Task[None]:
        """Unload an idle model: its queue is closed *now*, in the loop turn
        that decided it (no slot can be handed out after), and its engine
        freed on a worker thread by the task returned."""
        assert model.state == "loaded" and model.idle
        self._keep_alive.cancel(model)
        model.scheduler.close()
        model.set_state("unloading")
        log.info("unloading model %s (%s)", model.name, why)
        task = asyncio.create_task(self._free(model), name=f"unload-{model.name}")
        model.task = task
        return task

    async def close(self) -> None:
        """Release every engine (at shutdown, after every request completed)."""
        self._closing = True
        self._wake_room()
        self._keep_alive.close()
        for model in self._models.values():
            if model.task is not None and not model.task.done():
                # A load on its thread cannot be interrupted: let it finish,
                # then free it with the others.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await model.task
            await asyncio.to_thread(model.backend.close)

    # ------------------------------------------------------------ loading

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
                    model.scheduler.waiting == 0 and not (model.preload or model is self._default)
                ):
                    log.info("model %s: nobody waits for it any more; not loading it", model.name)
                    model.bytes = 0
                    model.set_state("unloaded")
                    return
                log.info(
                    "model %s: waiting for a busy model to become idle to fit the budget",
                    model.name,
                )
                await self._wait_for_room()
            # Each victim is closed now, in the loop turn that chose it: no
            # request can be handed one of its slots after the decision.
            await asyncio.gather(*(self.unload(self._models[key], "for room") for key in victims))
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
            model.set_state("unloaded")
            raise
        except Exception as exc:
            model.load_error = exc
            model.load_failures += 1
            model.bytes = 0
            model.set_state("unloaded")
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
        model.set_state("loaded")
        log.info("model %s loaded in %.1fs", model.name, loop.time() - started)
        model.scheduler.open()
        self.check_idle(model)

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

    # ------------------------------------------------------------ room under the budget

    def _resident(self, *, besides: Model) -> list[Resident]:
        return [
            Resident(key, m.bytes, m.state == "loaded" and m.idle, m.last_used)
            for key, m in self._models.items()
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

    async def _free(self, model: Model) -> None:
        await asyncio.to_thread(model.backend.close)
        model.bytes = 0
        model.unloads += 1
        model.set_state("unloaded")
        self._wake_room()
        if model.scheduler.waiting and not self._closing:
            # Requests came while it was being unloaded: load it again.
            self.load(model)

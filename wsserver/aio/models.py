"""The model registry: every model the server serves, found by name, loaded on demand.

Theory of operation
-------------------
Each model the server serves is a :class:`~wsserver.aio.model.Model`: its
backend (for llama, a :class:`~wsserver.backends.llama.LlamaBackend` with its
own context, batch, queue and prefix cache) and its own
:class:`~wsserver.aio.scheduler.Scheduler` (the queue of requests waiting for
one of its slots, with their positions). The scheduler is *closed* while the
model is not loaded: requests for it wait in its queue, and their ``queued``
frames say ``loading``.

:class:`ModelPool` is what the rest of the server sees of them:

* **lookup** — the model a request names (:meth:`ModelPool.lookup`): the
  default, a configured name or alias, a model an engine chooses among
  itself (an upstream's), else ``model_not_found`` before anything is
  queued; a model a client pulls joins them (:meth:`ModelPool.add_pulled`);
* **requests** — :meth:`ModelPool.acquire` waits for one of the model's
  slots, starting its load if it is unloaded, and :meth:`ModelPool.release`
  gives the slot back; a cancelled waiter leaves the queue at once (the
  scheduler's rule);
* **figures** — the models as ``hello`` and ``GET /v1/models`` list them,
  their ``/metrics``, and what ``/readyz`` hears from their engines.

Loading and unloading — a Hub model's pull, room under the memory budget,
the engine loaded and freed on a worker thread — are
:mod:`wsserver.aio.model_loader`'s; when an idle model's time is up,
:mod:`wsserver.aio.keep_alive`'s.

The default model is loaded when the server starts, with every model marked
``preload``; the server is ready when they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Hashable, Sequence

from ..backends import ModelEntry, pulled_model
from ..config import Config
from ..core.models import ModelInfo, ModelState
from ..core.protocol import Generate, Progress
from ..errors import ProtocolError
from ..pull.hub import Pulled
from .model import Model, ModelStats
from .model_loader import ModelLoader
from .pulls import Pulls

__all__ = ["Model", "ModelPool", "ModelStats"]

log = logging.getLogger("wsserver.models")

#: A waiter's position callback: its place in the model's queue, whether the
#: model is still loading, and how far its download is (if it downloads).
QueuedCallback = Callable[[int, bool, Progress | None], None]


class ModelPool:
    """Every model the server serves (see the module docstring)."""

    def __init__(
        self, specs: Sequence[ModelEntry], *, budget: int = 0, pulls: Pulls | None = None
    ) -> None:
        if not specs:
            raise ValueError("a server serves at least one model")
        self.models: dict[str, Model] = {spec.name: Model(spec) for spec in specs}
        self.default = next(iter(self.models.values()))
        #: Each alias → its model (create_models refused any clash).
        self.aliases: dict[str, Model] = {
            alias: model for model in self.models.values() for alias in model.aliases
        }
        self._loader = ModelLoader(self.models, self.default, budget=budget, pulls=pulls)

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
        return [m.stats() for m in self.models.values()]

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
        self._loader.wanted(model)
        try:
            return await model.scheduler.acquire(
                request_id,
                lambda position: on_queued(position, model.state != "loaded", model.download),
                owner,
            )
        finally:
            self._loader.check_idle(model)

    def release(self, model: Model, slot: int, keep_alive: float | None = None) -> None:
        """A request's engine is done with ``slot``; ``keep_alive``: the
        request's own (seconds once idle; 0 = unload at once, -1 = only for room)."""
        model.scheduler.release(slot)
        self._loader.check_idle(model, keep_alive)

    # ------------------------------------------------------------ start and stop

    async def start(self) -> None:
        """Load the default model and the preloaded ones; raise if the default fails."""
        first = [
            self.default,
            *(m for m in self.models.values() if m.preload and m is not self.default),
        ]
        for model in first:
            if model.state == "unloaded":
                self._loader.load(model)
            assert model.task is not None
            await asyncio.shield(model.task)
            if model.load_error is not None and model is self.default:
                raise model.load_error

    async def close(self) -> None:
        """Release every engine (at shutdown, after every request completed)."""
        await self._loader.close()

    async def wait_state(self, name: str, state: str) -> None:
        """Wait until model ``name`` is in ``state`` (tests, tools)."""
        model = self.models[name]
        while model.state != state:
            await model.changed.wait()

"""One served model: its engine, its queue and where it stands.

A :class:`Model` is the registry's record of one model
(:class:`~wsserver.aio.models.ModelPool`): its backend, its
:class:`~wsserver.aio.scheduler.Scheduler`, its state (``unloaded``,
``loading``, ``loaded``, ``unloading``) and what its loads cost so far. The
registry's loader (:mod:`wsserver.aio.model_loader`) moves it from state to
state; this module only keeps the record and says what it shows: its
:class:`~wsserver.core.models.ModelInfo` for clients and its :class:`ModelStats`
for ``/metrics``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..backends import ModelEntry
from ..backends.base import Liveness
from ..core.models import ModelInfo, ModelState
from ..core.protocol import Progress
from ..pull.hub import Pulled
from .scheduler import Scheduler

__all__ = ["Model", "ModelStats"]


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
    #: Its prompt cache in host memory (:class:`~wsserver.backends.base.PromptCacheFigures`).
    prompt_cache_hits: int = 0
    prompt_cache_restored_tokens: int = 0
    prompt_cache_bytes: int = 0
    #: Speculative decoding's draft tokens decoded and accepted since the load.
    draft_tokens: int = 0
    draft_tokens_accepted: int = 0


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
        """The model as ``hello`` and ``GET /v1/models`` show it."""
        state: ModelState = self.state if self.state in ("loaded", "loading") else "unloaded"
        return ModelInfo(
            name=self.name,
            state=state,
            n_ctx=getattr(self.backend, "n_ctx", None),
            parallel=self.backend.slots,
            max_waiting=self.backend.max_waiting,
            aliases=self.aliases,
            chat_template=self.backend.has_chat_template() if state == "loaded" else None,
            embeddings=self._embeddings() if state == "loaded" else None,
            input_modalities=self.backend.input_modalities() if state == "loaded" else None,
        )

    def _embeddings(self) -> str:
        door = self.backend.embeddings()
        return door.kind if door is not None else "none"

    def stats(self) -> ModelStats:
        """Its figures for ``/metrics`` (the engine's liveness only while loaded)."""
        live = self.backend.liveness() if self.state == "loaded" else Liveness()
        cache = self.backend.prompt_cache()
        counters = self.backend.stats() if self.state == "loaded" else {}
        return ModelStats(
            name=self.name,
            loaded=self.state == "loaded",
            active=self.scheduler.busy,
            queued=self.scheduler.waiting,
            memory_bytes=self.bytes,
            loads=self.loads,
            unloads=self.unloads,
            load_failures=self.load_failures,
            step_seconds=live.step_seconds,
            stalled=live.stalled,
            grammar_calls_running=live.grammar_calls_running,
            prompt_cache_hits=cache.hits,
            prompt_cache_restored_tokens=cache.restored_tokens,
            prompt_cache_bytes=cache.bytes,
            draft_tokens=counters.get("draft_tokens", 0),
            draft_tokens_accepted=counters.get("draft_tokens_accepted", 0),
        )

    def set_state(self, state: str) -> None:
        """Move to ``state`` and wake whoever waits on :attr:`changed`."""
        self.state = state
        self.changed.set()
        self.changed = asyncio.Event()

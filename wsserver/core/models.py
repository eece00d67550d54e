"""Several models on one server: what the registry decides, without I/O.

The asyncio half (:mod:`wsserver.aio.models`) loads and unloads engines on
worker threads; the decisions are here, as plain functions and data:

* :class:`ModelInfo` — one model as ``hello`` and ``GET /v1/models`` show it:
  its name, its state (``loaded``, ``loading``, ``unloaded``) and its limits.
* :func:`plan_room` — which idle models to unload so that a model of ``need``
  bytes fits the memory budget: least recently used first, never one with a
  running or queued request. ``None`` when even unloading every idle model
  would not make room while other models are busy: the load waits until one
  of them is idle. A model that alone exceeds the budget is still loaded once
  nothing else is resident (a budget must not make the only model unservable),
  and the registry logs a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["MODEL_STATES", "ModelInfo", "ModelState", "Resident", "plan_room"]

ModelState = Literal["loaded", "loading", "unloaded"]
MODEL_STATES: Final = ("loaded", "loading", "unloaded")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model the server serves, as clients are told."""

    name: str
    state: ModelState
    #: Tokens per request (prompt + completion); ``None`` if the engine does not say.
    n_ctx: int | None = None
    #: Requests it runs at once (0 = no limit).
    parallel: int = 0
    #: Requests that may wait for it before ``overloaded``.
    max_waiting: int = 0
    #: More names requests may give for it (its configured ``aliases``).
    aliases: tuple[str, ...] = ()
    #: Whether it has a chat template (``False``: a base model, which
    #: continues text; chats get a plain-text rendering). ``None``: not known
    #: (not loaded yet, or an engine without templates). Written when known.
    chat_template: bool | None = None
    #: What it serves besides generation, once loaded: ``embed`` (vectors,
    #: ``/v1/embeddings``), ``rerank`` (a reranker, ``/v1/rerank``) or
    #: ``none``; ``None``: not known yet (not loaded). Written when known.
    embeddings: str | None = None
    #: What it takes in: ``"text"``, and ``"image"`` / ``"audio"`` for a
    #: model whose projector encodes them. ``None``: not known (not loaded
    #: yet, or an engine that does not say). Written when known.
    input_modalities: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Resident:
    """A model holding memory: loaded, loading or being unloaded."""

    name: str
    bytes: int
    #: Loaded, with no running or queued request: it may be unloaded.
    idle: bool
    #: When its last request ended (any monotonic clock); smaller = older.
    last_used: float


def plan_room(need: int, budget: int, resident: Sequence[Resident]) -> list[str] | None:
    """The models to unload, oldest first, for ``need`` more bytes to fit ``budget``.

    ``[]``: it fits as things are. ``None``: it cannot fit until a busy model
    becomes idle. When nothing busy is left and it still does not fit, every
    idle model is unloaded and the answer is that list (the caller loads it
    anyway, over the budget).
    """
    used = sum(r.bytes for r in resident)
    if used + need <= budget:
        return []
    victims: list[str] = []
    for model in sorted((r for r in resident if r.idle), key=lambda r: r.last_used):
        victims.append(model.name)
        used -= model.bytes
        if used + need <= budget:
            return victims
    if all(r.idle for r in resident):
        return victims
    return None

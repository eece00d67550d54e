"""What every request of one server uses, whatever its wire: built once by the server."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import Backend
from ..config import Config
from ..core.protocol import Limits
from .metrics import Metrics
from .models import ModelPool
from .pulls import Pulls
from .scheduler import Scheduler

__all__ = ["Services"]


@dataclass(frozen=True, slots=True, eq=False)
class Services:
    """The server's parts that requests share, over WebSocket and HTTP alike."""

    config: Config
    #: The default model's engine and queue (``models`` has every model).
    backend: Backend
    scheduler: Scheduler
    models: ModelPool
    metrics: Metrics
    #: What a request may ask for (``hello`` tells a WebSocket client).
    wire_limits: Limits
    server_name: str
    #: Tasks started from callbacks, kept referenced until they finish.
    background: set[asyncio.Task[Any]]
    #: Downloads from the Hugging Face Hub (``None``: this server pulls nothing).
    pulls: Pulls | None = None
    #: The slots embedding requests hold, by request (:mod:`.embed_run`): a
    #: slot held by one is owned (the scheduler's books, ``/readyz``).
    embed_slots: dict[object, tuple[str, int]] = field(default_factory=dict)

    def in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a coroutine beside the caller; kept referenced until it ends."""
        task = asyncio.create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

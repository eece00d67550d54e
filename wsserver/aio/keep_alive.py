"""Keep-alive: when an idle model is unloaded for time (not for room).

Once a loaded model is idle — nothing running, nothing queued — it stays
loaded for its keep-alive, then is unloaded. The keep-alive is the last
finished request's own (``keep_alive`` in ``generate`` and the HTTP APIs'
bodies), else the model's ``keep_alive_s``: seconds; 0 = at once; -1 (and a
``keep_alive_s`` of 0) = only when its memory is needed for another model.
A request that comes for the model stops its timer; the next idle moment
starts a new one.

:class:`KeepAlive` keeps each model's timer and the keep-alive its last
request asked for; the registry's loader (:mod:`wsserver.aio.model_loader`)
tells it when a model goes idle or is wanted again, and is called back to
unload one whose time is up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .model import Model

__all__ = ["KeepAlive"]


class KeepAlive:
    """Each idle model's keep-alive timer (see the module docstring)."""

    def __init__(self, expire: Callable[[Model], object]) -> None:
        #: Unloads a model whose keep-alive ran out (it is loaded and idle).
        self._expire = expire
        self._timers: dict[Model, asyncio.TimerHandle] = {}
        #: The keep-alive each model's last finished request asked for, until applied.
        self._asked: dict[Model, float] = {}
        self._closed = False

    def ask(self, model: Model, keep_alive: float) -> None:
        """A finished request's own keep-alive, applied the next time ``model`` is idle."""
        self._asked[model] = keep_alive

    def start(self, model: Model) -> None:
        """``model`` is idle: start its timer, if it is loaded and its keep-alive
        (the last request's, else the model's) is not "only for room"."""
        wait = self._asked.pop(model, None)
        if wait is None:
            wait = model.keep_alive_s if model.keep_alive_s > 0 else -1.0
        if model.state == "loaded" and wait >= 0 and not self._closed:
            self.cancel(model)
            self._timers[model] = asyncio.get_running_loop().call_later(wait, self._expired, model)

    def cancel(self, model: Model) -> None:
        """Stop ``model``'s timer: a request wants it, or it is being unloaded."""
        timer = self._timers.pop(model, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        """Stop every timer, for good (the server shuts down)."""
        self._closed = True
        timers, self._timers = self._timers, {}
        for timer in timers.values():
            timer.cancel()

    def _expired(self, model: Model) -> None:
        self._timers.pop(model, None)
        if model.state == "loaded" and model.idle:
            self._expire(model)

"""wsserver: stream a local LLM's output to WebSocket clients, without the stutter.

Layers, by dependency direction: the sans-I/O core — :mod:`~wsserver.protocol`
(wire frames; the client's parsed by :mod:`~wsserver.client_frames`),
:mod:`~wsserver.session` (per-connection state machine, its table in
:mod:`~wsserver.transitions`, fed with :mod:`~wsserver.events`; a request's
record in :mod:`~wsserver.request_record`, its replay tail in
:mod:`~wsserver.replay`), :mod:`~wsserver.openai_api`, :mod:`~wsserver.sse`,
:mod:`~wsserver.pacing`, :mod:`~wsserver.textstream`, :mod:`~wsserver.security`
— and the engine seam (:mod:`wsserver.backends.base`, with the engines in
:mod:`wsserver.backends`) → the asyncio layer, :mod:`wsserver.aio`.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]

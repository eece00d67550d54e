"""wsserver: stream a local LLM's output to WebSocket clients, without the stutter.

Layers, by dependency direction: the sans-I/O core — :mod:`~wsserver.core.protocol`
(wire frames; the client's parsed by :mod:`~wsserver.core.client_frames`),
:mod:`~wsserver.core.session` (per-connection state machine, its table in
:mod:`~wsserver.core.transitions`, fed with :mod:`~wsserver.core.events`; a request's
record in :mod:`~wsserver.core.request_record`, its replay tail in
:mod:`~wsserver.core.replay`), :mod:`~wsserver.dialects.openai.api`, :mod:`~wsserver.sse`,
:mod:`~wsserver.core.pacing`, :mod:`~wsserver.core.textstream`, :mod:`~wsserver.security`
— and the engine seam (:mod:`wsserver.backends.base`, with the engines in
:mod:`wsserver.backends`) → the asyncio layer, :mod:`wsserver.aio`.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]

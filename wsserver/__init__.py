"""wsserver: stream a local LLM's output to WebSocket clients, without the stutter.

Layers, by dependency direction: :mod:`~wsserver.protocol` (wire frames) →
:mod:`~wsserver.session` (per-connection state machine) → the asyncio layer
(:mod:`~wsserver.connection`, :mod:`~wsserver.server`). Backends live in
:mod:`wsserver.backends` behind one small interface.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]

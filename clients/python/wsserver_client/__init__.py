"""The bundled Python clients for wsserver (protocol v1).

``wsserver_client.Client`` is the asyncio client; ``wsserver_client.sync.Client``
the synchronous one, with the same shape. Both are a
:class:`~wsserver_client.base.ClientBase` (the options and the calls that only
build requests) and run on the sans-I/O :mod:`wsserver_client.core` (requests,
frames, routing) with its reconnect/resume policy,
:mod:`wsserver_client.reconnect`; each adds only its I/O.
"""

from __future__ import annotations

from .client import Client, GenerationError, RequestResult, Stream
from .core import Embedding, Event, Reasoning, Text, ToolCall, ToolCallDelta

__all__ = [
    "Client",
    "Embedding",
    "Event",
    "GenerationError",
    "Reasoning",
    "RequestResult",
    "Stream",
    "Text",
    "ToolCall",
    "ToolCallDelta",
]

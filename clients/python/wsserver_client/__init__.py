"""The bundled Python clients for wsserver (protocol v1).

``wsserver_client.Client`` is the asyncio client; ``wsserver_client.sync.Client``
the synchronous one, with the same shape. Both run on the sans-I/O
:mod:`wsserver_client.core`.
"""

from __future__ import annotations

from .client import Client, GenerationError, RequestResult, Stream

__all__ = ["Client", "GenerationError", "RequestResult", "Stream"]

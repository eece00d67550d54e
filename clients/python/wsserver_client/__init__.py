"""The bundled Python client for wsserver (protocol v1)."""

from __future__ import annotations

from .client import Client, GenerationError, RequestResult, Stream

__all__ = ["Client", "GenerationError", "RequestResult", "Stream"]

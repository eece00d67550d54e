"""Engines behind one seam (see :mod:`wsserver.backends.base`)."""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from .base import Backend, GenerationRequest, Sink, Submission, ThreadedBackend, TokenSink
from .fake import FakeBackend

__all__ = [
    "Backend",
    "GenerationRequest",
    "Sink",
    "Submission",
    "ThreadedBackend",
    "TokenSink",
    "create_backend",
]


def create_backend(config: Config) -> Backend:
    """The backend the configuration names. Nothing is loaded yet."""
    kind = config.backend.kind
    if kind == "fake":
        fake = config.backend.fake
        return FakeBackend(
            tokens_per_s=fake.tokens_per_s,
            prefill_ms_per_token=fake.prefill_ms_per_token,
            parallel=fake.parallel,
            max_waiting=fake.max_waiting,
            text=Path(fake.text_file).read_text(encoding="utf-8") if fake.text_file else None,
            echo=fake.echo,
        )
    if kind == "llama":
        # Imported lazily: llama_cpp is heavy and only this backend needs it.
        from .llama import LlamaBackend

        return LlamaBackend.from_config(config.backend.llama)
    if kind == "openai":
        # Imported lazily, like llama: only this backend needs aiohttp.
        from .openai import OpenAIBackend

        return OpenAIBackend.from_config(config.backend.openai)
    raise ValueError(f"unknown backend kind {kind!r}")  # config validation prevents this

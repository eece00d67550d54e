"""Engines behind one seam (see :mod:`wsserver.backends.base`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, LlamaConfig
from ..errors import ConfigError
from .base import Backend, GenerationRequest, Sink, Submission, ThreadedBackend, TokenSink
from .fake import FakeBackend

__all__ = [
    "Backend",
    "GenerationRequest",
    "ModelEntry",
    "Sink",
    "Submission",
    "ThreadedBackend",
    "TokenSink",
    "create_backend",
    "create_models",
]


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model the configuration lists: its name, its (unloaded) engine, its policy."""

    name: str
    backend: Backend
    keep_alive_s: float = 0.0
    preload: bool = False


def create_models(config: Config) -> list[ModelEntry]:
    """Every model the configuration serves, the default first. Nothing is loaded.

    For the llama backend: ``backend.llama.model`` (when set, or when nothing
    else is listed: the default model's package), then each
    ``[[backend.llama.models]]`` table, then the ``*.gguf`` files of
    ``backend.llama.models_dir`` (by name). Any other backend serves one model.
    """
    if config.backend.kind != "llama":
        backend = create_backend(config)
        return [ModelEntry(backend.model_name, backend)]
    from .llama import LlamaBackend

    llama = config.backend.llama
    entries: list[ModelEntry] = []
    paths: dict[str, str] = {}

    def add(name: str, settings: LlamaConfig, preload: bool, where: str) -> None:
        if name in paths:
            taken = paths[name] or "the default model"
            raise ConfigError(f"{where}: the model name {name!r} is already taken (by {taken})")
        paths[name] = settings.model
        backend = LlamaBackend.from_config(settings, name=name)
        entries.append(ModelEntry(name, backend, settings.keep_alive_s, preload))

    dir_files: list[Path] = []
    if llama.models_dir:
        folder = Path(llama.models_dir)
        if not folder.is_dir():
            raise ConfigError(f"backend.llama.models_dir: {folder} is not a directory")
        dir_files = sorted(folder.glob("*.gguf"))
    if llama.model or not (llama.models or dir_files):
        default = LlamaBackend.from_config(llama)
        paths[default.model_name] = llama.model
        entries.append(ModelEntry(default.model_name, default, llama.keep_alive_s, True))
    for index, table in enumerate(llama.models):
        add(table.name, table.settings(llama), table.preload, f"backend.llama.models[{index}]")
    for path in dir_files:
        taken = paths.get(path.stem)
        if taken is not None and taken and Path(taken).resolve() == path.resolve():
            continue  # the same file, listed by name too
        settings = dataclasses.replace(llama, model=str(path), models=())
        add(path.stem, settings, False, f"backend.llama.models_dir {path}")
    return entries


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

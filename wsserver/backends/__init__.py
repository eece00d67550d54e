"""Engines behind one seam (see :mod:`wsserver.backends.base`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import MODEL_NAME_RE, Config, LlamaConfig
from ..errors import ConfigError, PullError
from ..pull.reference import PREFIX as HUB_PREFIX
from ..pull.reference import Reference, parse_reference
from .base import Backend, GenerationRequest, Sink, Submission, TokenSink
from .fake import FakeBackend
from .gguf_meta import read_metadata
from .threaded import ThreadedBackend

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
    "default_aliases",
    "pulled_model",
]


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model the configuration lists: its name, its (unloaded) engine, its policy."""

    name: str
    backend: Backend
    keep_alive_s: float = 0.0
    preload: bool = False
    #: More names requests may give for it (``aliases`` in its configuration).
    aliases: tuple[str, ...] = ()
    #: Its file is a Hub reference (``model = "hf:org/repo:Q4_K_M"``), pulled
    #: before its first load; ``use_file`` then tells the engine the file.
    reference: Reference | None = None
    use_file: Callable[[Path], None] | None = None


def hub_reference(model: str, where: str) -> Reference | None:
    """The reference a model setting names (``hf:…``), or ``None`` for a path."""
    if not model.startswith(HUB_PREFIX):
        return None
    try:
        return parse_reference(model)
    except PullError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None


def create_models(config: Config) -> list[ModelEntry]:
    """Every model the configuration serves, the default first. Nothing is loaded.

    For the llama backend: ``backend.llama.model`` (when set, or when nothing
    else is listed: the default model's package), then each
    ``[[backend.llama.models]]`` table, then the ``*.gguf`` files of
    ``backend.llama.models_dir`` (by name). Any other backend serves one model.
    Every name and alias is unique: a clash is a :class:`ConfigError`.
    """
    if config.backend.kind != "llama":
        backend = create_backend(config)
        entry = ModelEntry(backend.model_name, backend, aliases=default_aliases(config))
        _check_names([entry], f"backend.{config.backend.kind}.aliases")
        return [entry]
    from .llama import LlamaBackend

    llama = config.backend.llama
    entries: list[ModelEntry] = []
    paths: dict[str, str] = {}

    def add(
        name: str,
        settings: LlamaConfig,
        preload: bool,
        where: str,
        aliases: tuple[str, ...] = (),
    ) -> None:
        if name in paths:
            taken = paths[name] or "the default model"
            raise ConfigError(f"{where}: the model name {name!r} is already taken (by {taken})")
        paths[name] = settings.model
        backend = LlamaBackend.from_config(settings, name=name)
        reference = hub_reference(settings.model, f"{where}.model")
        entries.append(
            ModelEntry(
                name,
                backend,
                settings.keep_alive_s,
                preload,
                aliases,
                reference,
                _file_setter(backend) if reference else None,
            )
        )
        _check_names(entries, where)

    dir_files: list[Path] = []
    if llama.models_dir:
        folder = Path(llama.models_dir)
        if not folder.is_dir():
            raise ConfigError(f"backend.llama.models_dir: {folder} is not a directory")
        # A vision projector beside its model is no model of its own.
        dir_files = [p for p in sorted(folder.glob("*.gguf")) if not _is_projector(p)]
    if llama.model or not (llama.models or dir_files):
        reference = hub_reference(llama.model, "backend.llama.model")
        default = LlamaBackend.from_config(llama, name=_reference_name(reference))
        paths[default.model_name] = llama.model
        aliases = tuple(llama.aliases)
        entries.append(
            ModelEntry(
                default.model_name,
                default,
                llama.keep_alive_s,
                True,
                aliases,
                reference,
                _file_setter(default) if reference else None,
            )
        )
        _check_names(entries, "backend.llama.aliases")
    elif llama.aliases:
        raise ConfigError(
            "backend.llama.aliases: they name backend.llama.model, and none is served "
            "(give each [[backend.llama.models]] table its own aliases)"
        )
    for index, table in enumerate(llama.models):
        where = f"backend.llama.models[{index}]"
        add(table.name, table.settings(llama), table.preload, where, table.aliases)
    for path in dir_files:
        taken = paths.get(path.stem)
        if taken is not None and taken and Path(taken).resolve() == path.resolve():
            continue  # the same file, listed by name too
        # The default model's projector is its own: no other model inherits it.
        settings = dataclasses.replace(llama, model=str(path), mmproj="", models=(), aliases=[])
        add(path.stem, settings, False, f"backend.llama.models_dir {path}")
    return entries


def pulled_model(config: Config, reference: Reference, path: Path) -> ModelEntry:
    """A model a client pulled, served under its reference's name with the
    ``[backend.llama]`` settings (loaded on its first request)."""
    from .llama import LlamaBackend

    settings = dataclasses.replace(
        config.backend.llama, model=str(path), mmproj="", models=(), aliases=[]
    )
    backend = LlamaBackend.from_config(settings, name=reference.name)
    return ModelEntry(
        reference.name,
        backend,
        settings.keep_alive_s,
        False,
        (),
        reference,
        _file_setter(backend),
    )


def _reference_name(reference: Reference | None) -> str:
    """The default model's name when its file is a Hub reference: the
    reference without revision (``org/repo:Q4_K_M``), if that is a model name."""
    if reference is None:
        return ""
    name = reference.name
    if not MODEL_NAME_RE.fullmatch(name):
        raise ConfigError(
            f"backend.llama.model: {name[:140]!r} is too long to be the model's name; "
            "list it as a [[backend.llama.models]] table with a name of its own"
        )
    return name


def _file_setter(backend: Backend) -> Callable[[Path], None]:
    """How the registry tells a llama engine the file it pulled."""

    def use_file(path: Path) -> None:
        backend.model_path = str(path)  # type: ignore[attr-defined]

    return use_file


def default_aliases(config: Config) -> tuple[str, ...]:
    """The configured backend's ``aliases`` for its default model."""
    backend = config.backend
    if backend.kind == "fake":
        return tuple(backend.fake.aliases)
    if backend.kind == "openai":
        return tuple(backend.openai.aliases)
    return tuple(backend.llama.aliases)


def _check_names(entries: list[ModelEntry], where: str) -> None:
    """The last entry's name and aliases clash with no earlier name or alias
    (nor its own name: an alias is another name)."""
    *earlier, last = entries
    taken = {name: entry.name for entry in earlier for name in (entry.name, *entry.aliases)}
    if last.name in taken:
        raise ConfigError(
            f"{where}: the model name {last.name!r} is already an alias of "
            f"model {taken[last.name]!r}"
        )
    for alias in last.aliases:
        if alias == last.name:
            raise ConfigError(f"{where}: the alias {alias!r} is the model's own name")
        if alias in taken:
            raise ConfigError(
                f"{where}: the alias {alias!r} is already a name of model {taken[alias]!r}"
            )


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


def _is_projector(path: Path) -> bool:
    """Whether the GGUF at ``path`` is a vision projector (``clip``), by its header."""
    try:
        found = read_metadata(path, {"general.architecture"})
    except (OSError, ValueError):
        return False  # not for this question to judge: its load will say
    return found.get("general.architecture") == "clip"

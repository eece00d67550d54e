"""Configuration: one frozen object, loaded once at the edge.

Precedence, highest first: command-line flag > environment variable
(``WSSERVER_<SECTION>_<KEY>``, e.g. ``WSSERVER_SERVER_PORT`` or
``WSSERVER_BACKEND_FAKE_TOKENS_PER_S``) > ``--config`` file > built-in
defaults. config/default.toml lists every key with the built-in default and a
comment; a test keeps the two equal.

Validation is strict: an unknown key, a wrong type or a value out of range is a
:class:`~wsserver.errors.ConfigError` naming the key and where it came from,
and the server refuses to start.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .schema import MODEL_NAME_RE, MODEL_OVERRIDES, Config, LlamaConfig, LlamaModelConfig

__all__ = ["KEYS", "SECRET_KEYS", "LoadedConfig", "describe", "env_name", "load_config"]


def _section(cls: type, f: dataclasses.Field[Any]) -> type | None:
    """The config class of a field that is a section of its own, else None.

    Found from the field's type itself (a nested dataclass), so a new section
    needs no registration anywhere. Annotations are strings here
    (``from __future__ import annotations``); ``get_type_hints`` resolves them.
    """
    hint = typing.get_type_hints(cls)[f.name]
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _leaves(
    cls: type, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], dataclasses.Field[Any]]:
    """Every settable key of a config class, as a path → field map."""
    out: dict[tuple[str, ...], dataclasses.Field[Any]] = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        section = _section(cls, f)
        if section is not None:
            out.update(_leaves(section, path))
        else:
            out[path] = f
    return out


KEYS: dict[tuple[str, ...], dataclasses.Field[Any]] = _leaves(Config)


def env_name(path: tuple[str, ...]) -> str:
    return "WSSERVER_" + "_".join(path).upper()


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    factory: Any = f.default_factory
    return factory()


def _coerce(path: tuple[str, ...], f: dataclasses.Field[Any], value: Any, source: str) -> Any:
    name = ".".join(path)
    kind = type(_default(f))
    if isinstance(value, str) and source.startswith(("env", "flag")) and kind is not str:
        # Environment variables and --set values are strings: parse them as TOML values.
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            raise ConfigError(
                f"{name} (from {source}): cannot parse {value!r} as {kind.__name__}"
            ) from None
    if kind is tuple:
        return _model_tables(name, value, source)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} (from {source}): expected a list of strings, got {value!r}")
    elif type(value) is not kind:
        raise ConfigError(
            f"{name} (from {source}): expected {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    low, high, choices = f.metadata.get("low"), f.metadata.get("high"), f.metadata.get("choices")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{name} (from {source}): {value!r} is out of range [{low:g}, {high:g}]")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name} (from {source}): {value!r} is not one of {', '.join(choices)}")
    return value


def _model_tables(name: str, value: Any, source: str) -> tuple[LlamaModelConfig, ...]:
    """``[[backend.llama.models]]``: a list of tables, each checked key by key."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"{name} (from {source}): expected a list of tables, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(LlamaConfig)}
    models: list[LlamaModelConfig] = []
    seen: set[str] = set()
    for index, table in enumerate(value):
        where = f"{name}[{index}]"
        model_name = table.get("name")
        if not isinstance(model_name, str) or not MODEL_NAME_RE.fullmatch(model_name):
            raise ConfigError(
                f"{where}.name (from {source}): give a name of 1-128 characters of "
                "A-Z a-z 0-9 and . _ : + / - (starting with a letter or digit)"
            )
        if model_name in seen:
            raise ConfigError(f"{where}.name (from {source}): {model_name!r} is listed twice")
        seen.add(model_name)
        path = table.get("model")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}.model (from {source}): give the GGUF file's path")
        preload = table.get("preload", False)
        if not isinstance(preload, bool):
            raise ConfigError(f"{where}.preload (from {source}): expected bool, got {preload!r}")
        aliases = _check_aliases(f"{where}.aliases", table.get("aliases", []), source)
        overrides: list[tuple[str, Any]] = []
        for key, setting in table.items():
            if key in ("name", "model", "preload", "aliases"):
                continue
            if key not in MODEL_OVERRIDES:
                raise ConfigError(
                    f"unknown key {where}.{key} in {source}{_renamed(key)} (a model may set name, model, "
                    f"preload, aliases, {', '.join(MODEL_OVERRIDES)})"
                )
            path_key = ("backend", "llama", f"models[{index}]", key)
            overrides.append((key, _coerce(path_key, fields[key], setting, source)))
        models.append(LlamaModelConfig(model_name, path, tuple(overrides), preload, tuple(aliases)))
    return tuple(models)


def _check_aliases(name: str, value: Any, source: str) -> list[str]:
    """A list of model names: each a valid name, none twice. (A clash with
    another model's name or alias is found where every name is known:
    :func:`wsserver.backends.create_models`.)"""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{name} (from {source}): expected a list of strings, got {value!r}")
    for alias in value:
        if not MODEL_NAME_RE.fullmatch(alias):
            raise ConfigError(
                f"{name} (from {source}): {alias[:140]!r} is not a model name (1-128 characters "
                "of A-Z a-z 0-9 and . _ : + / -, starting with a letter or digit)"
            )
        if value.count(alias) > 1:
            raise ConfigError(f"{name} (from {source}): {alias!r} is listed twice")
    return value


#: Keys that were renamed: their old name's error says the new one.
RENAMED = {"prefill_floor_ms": "prefill_gap_ms (issue 40: now the freeze bound itself, 200 ms)"}


def _renamed(key: str) -> str:
    """`` (renamed: …)`` for a key that has a new name, else ""."""
    new = RENAMED.get(key.rsplit(".", 1)[-1].removeprefix("WSSERVER_BACKEND_LLAMA_").lower())
    return f" (renamed: {new})" if new else ""


def _flatten(
    table: Mapping[str, Any], source: str, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in table.items():
        path = (*prefix, key)
        if isinstance(value, dict) and path not in KEYS:
            if not any(k[: len(path)] == path for k in KEYS):
                raise ConfigError(f"unknown section [{'.'.join(path)}] in {source}")
            out.update(_flatten(value, source, path))
        elif path not in KEYS:
            dotted = ".".join(path)
            raise ConfigError(f"unknown key {dotted} in {source}{_renamed(dotted)}")
        else:
            out[path] = value
    return out


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    config: Config
    #: Where each key's effective value came from ("default", "file PATH", "env NAME", "flag").
    sources: Mapping[str, str]


def load_config(
    *,
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LoadedConfig:
    """Build the effective configuration. ``overrides`` maps dotted keys to flag values."""
    env = os.environ if env is None else env
    values: dict[tuple[str, ...], Any] = {p: _default(f) for p, f in KEYS.items()}
    sources: dict[tuple[str, ...], str] = {p: "default" for p in KEYS}
    if path is not None:
        source = f"file {path}"
        try:
            table = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        for key, value in _flatten(table, source).items():
            values[key] = _coerce(key, KEYS[key], value, source)
            sources[key] = source
    for key, raw, name in _hub_environment(env):
        values[key] = _coerce(key, KEYS[key], raw, f"env {name}")
        sources[key] = f"env {name}"
    known_env = {env_name(p): p for p in KEYS}
    for name, raw in env.items():
        if not name.startswith("WSSERVER_"):
            continue
        env_key = known_env.get(name)
        if env_key is None:
            raise ConfigError(f"unknown environment variable {name}{_renamed(name)}")
        values[env_key] = _coerce(env_key, KEYS[env_key], raw, f"env {name}")
        sources[env_key] = f"env {name}"
    for dotted, value in (overrides or {}).items():
        key = tuple(dotted.split("."))
        if key not in KEYS:
            raise ConfigError(f"unknown key {dotted} (from flag){_renamed(dotted)}")
        values[key] = _coerce(key, KEYS[key], value, "flag")
        sources[key] = "flag"
    config = _build(Config, values, ())
    limits = config.limits
    if limits.default_max_tokens > limits.max_tokens:
        raise ConfigError("limits.default_max_tokens must not exceed limits.max_tokens")
    token = config.security.auth_token
    if token and not _TOKEN_RE.fullmatch(token):
        # The token travels in a Sec-WebSocket-Protocol value, which only allows
        # RFC 7230 token characters.
        raise ConfigError(
            f"security.auth_token (from {sources[('security', 'auth_token')]}): "
            "use 1-512 characters of A-Z a-z 0-9 and !#$%&'*+-.^_`|~"
        )
    _check_urls(config.backend.openai.urls, sources[("backend", "openai", "urls")])
    for section in ("fake", "llama", "openai"):
        key = ("backend", section, "aliases")
        _check_aliases(".".join(key), getattr(config.backend, section).aliases, sources[key])
    openai = config.backend.openai
    if openai.aliases and not openai.model:
        raise ConfigError(
            f"backend.openai.aliases (from {sources[('backend', 'openai', 'aliases')]}): "
            "aliases name backend.openai.model, and none is set (without it, requests "
            "name the models the upstreams list)"
        )
    if config.models.allow_pull and not token:
        raise ConfigError(
            f"models.allow_pull (from {sources[('models', 'allow_pull')]}) needs "
            "security.auth_token: a pull writes gigabytes to this machine's disk on a "
            "client's word (docs/models.md, 'Who may pull')"
        )
    endpoint = config.models.endpoint
    if endpoint and not _ENDPOINT_RE.fullmatch(endpoint):
        raise ConfigError(
            f"models.endpoint (from {sources[('models', 'endpoint')]}): {endpoint!r} is not "
            "an http(s) URL"
        )
    _check_fetch_hosts(config.images.fetch_hosts, sources[("images", "fetch_hosts")])
    llama = config.backend.llama
    if llama.cache_type_v != "f16" and llama.flash_attn == "off":
        raise ConfigError(
            f"backend.llama.cache_type_v = {llama.cache_type_v!r} (from "
            f"{sources[('backend', 'llama', 'cache_type_v')]}) needs flash attention: "
            'set backend.llama.flash_attn to "on" or "auto"'
        )
    return LoadedConfig(config=config, sources={".".join(k): v for k, v in sources.items()})


def _check_urls(urls: list[str], source: str) -> None:
    if not urls:
        raise ConfigError(f"backend.openai.urls (from {source}): list at least one upstream")
    for url in urls:
        if not _UPSTREAM_RE.fullmatch(url):
            raise ConfigError(
                f"backend.openai.urls (from {source}): {url!r} is not an http(s) URL ending in /v1"
            )


def _check_fetch_hosts(hosts: list[str], source: str) -> None:
    for host in hosts:
        match = _FETCH_HOST_RE.fullmatch(host)
        port = (match[1] or match[2]) if match is not None else None
        if match is None or (port is not None and not 0 < int(port) < 65536):
            raise ConfigError(
                f"images.fetch_hosts (from {source}): {host!r} is not a host name, "
                "'*.' and a domain, or an IP address, with an optional ':port'"
            )


#: A fetch_hosts entry: a name, ``*.`` + a domain, an IPv4 or [IPv6] address; a port.
_FETCH_HOST_RE = re.compile(
    r"(?:\*\.)?(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)*[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?::(\d{1,5}))?|\[[0-9A-Fa-f:.]+\](?::(\d{1,5}))?"
)
_UPSTREAM_RE = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?/v1")
_ENDPOINT_RE = re.compile(r"https?://[^\s/?#@]+(/[^\s?#]*)?")


def _hub_environment(env: Mapping[str, str]) -> list[tuple[tuple[str, ...], str, str]]:
    """The Hub's own environment variables, as huggingface_hub reads them, for
    the ``[models]`` keys they mean: (key, value, variable). They rank with the
    environment, below ``WSSERVER_MODELS_*``."""
    found: list[tuple[tuple[str, ...], str, str]] = []
    if env.get("HF_ENDPOINT"):
        found.append((("models", "endpoint"), env["HF_ENDPOINT"].rstrip("/"), "HF_ENDPOINT"))
    if env.get("HF_HUB_CACHE"):
        found.append((("models", "cache_dir"), env["HF_HUB_CACHE"], "HF_HUB_CACHE"))
    elif env.get("HF_HOME"):
        home = os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
        found.append((("models", "cache_dir"), home, "HF_HOME"))
    offline = env.get("HF_HUB_OFFLINE")
    if offline is not None and offline.strip():
        value = "true" if offline.strip().upper() in ("1", "ON", "YES", "TRUE") else "false"
        found.append((("models", "offline"), value, "HF_HUB_OFFLINE"))
    return found


_TOKEN_RE = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]{1,512}")

#: Keys whose values ``describe()`` never prints.
SECRET_KEYS = frozenset({("security", "auth_token"), ("backend", "openai", "api_key")})


def _build(cls: type, values: Mapping[tuple[str, ...], Any], prefix: tuple[str, ...]) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        if path in values:
            kwargs[f.name] = values[path]
        else:
            section = _section(cls, f)
            assert section is not None, f"no value for {'.'.join(path)}"  # KEYS has every leaf
            kwargs[f.name] = _build(section, values, path)
    return cls(**kwargs)


def describe(loaded: LoadedConfig) -> str:
    """The effective configuration as TOML-ish lines with each value's source."""
    lines: list[str] = []
    section: tuple[str, ...] | None = None
    flat = {p: v for p, v in _iter_values(loaded.config, ())}
    for path in KEYS:
        if path[:-1] != section:
            section = path[:-1]
            lines.append(f"\n[{'.'.join(section)}]")
        value = flat[path]
        rendered = '"***"' if path in SECRET_KEYS and value else _toml_value(value)
        assignment = f"{path[-1]} = {rendered}"
        lines.append(f"{assignment:<36} # {loaded.sources['.'.join(path)]}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _iter_values(obj: Any, prefix: tuple[str, ...]) -> Any:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _iter_values(value, (*prefix, f.name))
        else:
            yield (*prefix, f.name), value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, LlamaModelConfig):
        pairs = [("name", value.name), ("model", value.model), *value.overrides]
        if value.preload:
            pairs.append(("preload", True))
        if value.aliases:
            pairs.append(("aliases", list(value.aliases)))
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in pairs) + "}"
    return repr(value)

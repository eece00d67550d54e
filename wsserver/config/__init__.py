"""Configuration: one frozen object (:mod:`.schema`), loaded once at the
edge (:mod:`.load`: file, environment and flags, validated strictly)."""

from __future__ import annotations

from .load import KEYS, SECRET_KEYS, LoadedConfig, describe, env_name, load_config
from .schema import (
    MODEL_NAME_RE,
    MODEL_OVERRIDES,
    BackendConfig,
    Config,
    FakeConfig,
    ImagesConfig,
    LimitsConfig,
    LlamaConfig,
    LlamaModelConfig,
    ModelsConfig,
    OpenAIConfig,
    SecurityConfig,
    ServerConfig,
    StreamConfig,
    TemplateConfig,
)

__all__ = [
    "KEYS",
    "MODEL_NAME_RE",
    "MODEL_OVERRIDES",
    "SECRET_KEYS",
    "BackendConfig",
    "Config",
    "FakeConfig",
    "ImagesConfig",
    "LimitsConfig",
    "LlamaConfig",
    "LlamaModelConfig",
    "LoadedConfig",
    "ModelsConfig",
    "OpenAIConfig",
    "SecurityConfig",
    "ServerConfig",
    "StreamConfig",
    "TemplateConfig",
    "describe",
    "env_name",
    "load_config",
]

"""The ``[models]`` section: the Hub's own environment variables, and who may pull."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsserver.config import describe, load_config
from wsserver.errors import ConfigError
from wsserver.pull.hub import DEFAULT_ENDPOINT, HubSettings


def test_the_hubs_environment_variables_set_the_models_keys() -> None:
    env = {"HF_ENDPOINT": "http://mirror.lan:8080/", "HF_HOME": "/data/hf", "HF_HUB_OFFLINE": "1"}
    loaded = load_config(env=env)
    models = loaded.config.models
    assert models.endpoint == "http://mirror.lan:8080"
    assert models.cache_dir == "/data/hf/hub"
    assert models.offline is True
    assert loaded.sources["models.offline"] == "env HF_HUB_OFFLINE"
    assert "env HF_HOME" in describe(loaded)
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub; "0" is not offline.
    models = load_config(
        env={"HF_HUB_CACHE": "/c", "HF_HOME": "/h", "HF_HUB_OFFLINE": "0"}
    ).config.models
    assert (models.cache_dir, models.offline) == ("/c", False)


def test_wsserver_settings_rank_above_the_hubs_variables(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text('[models]\ncache_dir = "/from/file"\n')
    env = {"HF_HUB_CACHE": "/from/hf", "WSSERVER_MODELS_ENDPOINT": "https://hub.example"}
    loaded = load_config(path=file, env={**env, "HF_ENDPOINT": "http://other"})
    assert loaded.config.models.cache_dir == "/from/hf"  # the environment over the file
    assert loaded.config.models.endpoint == "https://hub.example"
    flagged = load_config(path=file, env=env, overrides={"models.cache_dir": "/from/flag"})
    assert flagged.config.models.cache_dir == "/from/flag"


def test_settings_for_the_hub_come_from_the_section() -> None:
    models = load_config(env={}).config.models
    hub = HubSettings.from_config(models)
    assert hub.endpoint == DEFAULT_ENDPOINT and hub.cache_dir is None and not hub.offline
    assert hub.max_download_bytes == 64 << 30
    models = load_config(
        env={}, overrides={"models.cache_dir": "~/m", "models.endpoint": "http://h:1/"}
    ).config.models
    hub = HubSettings.from_config(models)
    assert hub.cache_dir == Path("~/m").expanduser() and hub.endpoint == "http://h:1"


def test_pulls_over_the_api_need_the_auth_token() -> None:
    with pytest.raises(ConfigError, match=r"models.allow_pull .* needs security.auth_token"):
        load_config(env={}, overrides={"models.allow_pull": "true"})
    loaded = load_config(
        env={"WSSERVER_SECURITY_AUTH_TOKEN": "s3cret"}, overrides={"models.allow_pull": "true"}
    )
    assert loaded.config.models.allow_pull


@pytest.mark.parametrize("endpoint", ["ftp://x", "huggingface.co", "http://a b", "http://u@h"])
def test_the_endpoint_must_be_an_http_url(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"models\.endpoint"):
        load_config(env={}, overrides={"models.endpoint": endpoint})

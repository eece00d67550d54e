"""Configuration loading: precedence, validation, and default.toml kept in sync."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

from wsserver.cli import main
from wsserver.config import KEYS, describe, env_name, load_config
from wsserver.errors import ConfigError


def test_default_toml_lists_every_key_with_the_builtin_default() -> None:
    from_file = load_config(path=ROOT / "config" / "default.toml", env={})
    assert from_file.config == load_config(env={}).config
    assert all(source.startswith("file") for source in from_file.sources.values()), [
        k for k, v in from_file.sources.items() if not v.startswith("file")
    ]


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 1111\nhost = "::1"\n[stream]\nflush_ms = 12\n')
    env = {"WSSERVER_SERVER_PORT": "2222", "WSSERVER_BACKEND_FAKE_TOKENS_PER_S": "7.5"}
    loaded = load_config(path=path, env=env, overrides={"server.port": "3333"})
    config = loaded.config
    assert config.server.port == 3333 and loaded.sources["server.port"] == "flag"
    assert config.backend.fake.tokens_per_s == 7.5
    assert loaded.sources["backend.fake.tokens_per_s"] == "env WSSERVER_BACKEND_FAKE_TOKENS_PER_S"
    assert config.server.host == "::1" and loaded.sources["server.host"] == f"file {path}"
    assert config.stream.flush_ms == 12.0  # an int in TOML is fine for a float key
    assert loaded.sources["stream.queue_tokens"] == "default"


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[server]\nprot = 1\n", "unknown key server.prot"),
        ("[sever]\nport = 1\n", "unknown section [sever]"),
        ('[server]\nport = "80"\n', "expected int"),
        ("[server]\nport = 70000\n", "out of range"),
        ('[backend]\nkind = "gpt"\n', "not one of"),
        ("[stream]\nflush_tokens = 0\n", "out of range"),
        ("[limits]\ndefault_max_tokens = 10\nmax_tokens = 5\n", "default_max_tokens"),
        ("not toml", "cannot read config file"),
        (
            "[backend.llama]\nprefill_floor_ms = 80\n",
            "unknown key backend.llama.prefill_floor_ms in file",
        ),
        ("[backend.llama]\nprefill_floor_ms = 80\n", "(renamed: prefill_gap_ms"),
    ],
)
def test_invalid_files_are_refused_with_a_clear_message(
    tmp_path: Path, toml: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path=path, env={})


def test_invalid_env_and_flags() -> None:
    with pytest.raises(ConfigError, match="unknown environment variable WSSERVER_NOPE"):
        load_config(env={"WSSERVER_NOPE": "1"})
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(env={"WSSERVER_SERVER_PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"unknown key x\.y"):
        load_config(env={}, overrides={"x.y": 1})
    with pytest.raises(ConfigError, match=r"WSSERVER_BACKEND_LLAMA_PREFILL_FLOOR_MS \(renamed"):
        load_config(env={"WSSERVER_BACKEND_LLAMA_PREFILL_FLOOR_MS": "80"})
    with pytest.raises(ConfigError, match=r"\(from flag\) \(renamed: prefill_gap_ms"):
        load_config(env={}, overrides={"backend.llama.prefill_floor_ms": 80})
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(path="/nonexistent/wsserver.toml", env={})


def test_env_names_are_derived_from_keys() -> None:
    assert env_name(("backend", "llama", "n_ctx")) == "WSSERVER_BACKEND_LLAMA_N_CTX"
    assert len({env_name(k) for k in KEYS}) == len(KEYS)


def test_config_show_prints_values_and_sources(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("WSSERVER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("WSSERVER_STREAM_FLUSH_MS", "20")
    assert main(["config", "show", "--port", "9999", "--set", "stream.flush_tokens=3"]) == 0
    out = capsys.readouterr().out
    assert "[server]" in out and "[backend.fake]" in out
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if "=" in line}
    assert "9999" in lines["port"] and "# flag" in lines["port"]
    assert "20.0" in lines["flush_ms"] and "env WSSERVER_STREAM_FLUSH_MS" in lines["flush_ms"]
    assert "# flag" in lines["flush_tokens"]
    assert "# default" in lines["host"]


def test_cli_refuses_bad_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--set", "server.port=-1"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["config", "show", "--set", "nonsense"]) == 2


def test_describe_round_trips_through_toml() -> None:
    import tomllib

    text = describe(load_config(env={}))
    parsed = tomllib.loads(text)
    assert parsed["server"]["port"] == 8765


def test_the_upstream_api_key_comes_from_the_environment_and_is_never_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("WSSERVER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("WSSERVER_BACKEND_OPENAI_API_KEY", "sk-secret-123")
    loaded = load_config()
    assert loaded.config.backend.openai.api_key == "sk-secret-123"
    assert main(["config", "show", "--set", "backend.kind=openai"]) == 0
    out = capsys.readouterr().out
    assert "sk-secret-123" not in out
    assert 'api_key = "***"' in out and "env WSSERVER_BACKEND_OPENAI_API_KEY" in out
    assert "sk-secret-123" not in describe(loaded)


@pytest.mark.parametrize(
    "urls",
    [[], ["http://h:8080"], ["http://h:8080/v1/"], ["ftp://h/v1"], ["http://a/v1", "b/v1"]],
)
def test_upstream_urls_must_be_http_and_end_in_v1(urls: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"backend\.openai\.urls"):
        load_config(env={}, overrides={"backend.openai.urls": urls})


def test_upstream_urls_may_have_a_path_and_https() -> None:
    urls = ["https://gpu.example:443/proxy/v1", "http://[::1]:8080/v1"]
    loaded = load_config(env={}, overrides={"backend.openai.urls": urls})
    assert loaded.config.backend.openai.urls == urls


def test_model_tables_are_read_checked_and_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tomllib

    path = tmp_path / "c.toml"
    path.write_text(
        "[backend.llama]\nkeep_alive_s = 30\nmodels_memory_bytes = 1000000000\n"
        'models_dir = "/srv/models"\n'
        '[[backend.llama.models]]\nname = "tiny"\nmodel = "/m/tiny.gguf"\n'
        "n_ctx = 512\nparallel = 2\npreload = true\n"
        '[[backend.llama.models]]\nname = "coder:7b"\nmodel = "/m/coder.gguf"\n'
    )
    loaded = load_config(path=path, env={})
    llama = loaded.config.backend.llama
    assert [m.name for m in llama.models] == ["tiny", "coder:7b"]
    tiny = llama.models[0].settings(llama)
    assert (tiny.model, tiny.n_ctx, tiny.parallel, tiny.n_batch) == ("/m/tiny.gguf", 512, 2, 512)
    assert llama.models[0].preload and not llama.models[1].preload
    assert (llama.keep_alive_s, llama.models_memory_bytes) == (30.0, 1_000_000_000)
    assert llama.models_dir == "/srv/models"
    assert main(["config", "show", "--config", str(path)]) == 0
    shown = tomllib.loads(re.sub(r"#.*", "", capsys.readouterr().out))["backend"]["llama"]
    assert shown["models"][0] == {
        "name": "tiny",
        "model": "/m/tiny.gguf",
        "n_ctx": 512,
        "parallel": 2,
        "preload": True,
    }
    assert shown["keep_alive_s"] == 30.0 and shown["models_dir"] == "/srv/models"


def test_the_default_configuration_has_no_extra_models() -> None:
    llama = load_config(env={}).config.backend.llama
    assert (llama.models, llama.models_dir, llama.models_memory_bytes, llama.keep_alive_s) == (
        (),
        "",
        0,
        0.0,
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('model = "/m/a.gguf"', "backend.llama.models[0].name"),
        ('name = "a"', "backend.llama.models[0].model ("),
        ('name = "bad name"\nmodel = "x"', "backend.llama.models[0].name"),
        ('name = "a"\nmodel = "x"\nn_ctx = 1', "backend.llama.models[0].n_ctx"),
        ('name = "a"\nmodel = "x"\nport = 1', "unknown key backend.llama.models[0].port"),
        ('name = "a"\nmodel = "x"\npreload = 1', "backend.llama.models[0].preload"),
    ],
)
def test_bad_model_tables_are_refused_naming_the_key(
    tmp_path: Path, table: str, message: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[[backend.llama.models]]\n{table}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path=path, env={})


def test_a_model_name_listed_twice_is_refused() -> None:
    env = {"WSSERVER_BACKEND_LLAMA_MODELS": '[{name="a", model="x"}, {name="a", model="y"}]'}
    with pytest.raises(ConfigError, match="'a' is listed twice"):
        load_config(env=env)


def test_aliases_are_read_for_each_model_and_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tomllib

    from wsserver.backends import create_models

    path = tmp_path / "c.toml"
    path.write_text(
        '[backend.llama]\nmodel = "/m/gemma.gguf"\naliases = ["gpt-4o", "test"]\n'
        '[[backend.llama.models]]\nname = "tiny"\nmodel = "/m/tiny.gguf"\naliases = ["small"]\n'
        '[[backend.llama.models]]\nname = "coder"\nmodel = "/m/coder.gguf"\n'
    )
    loaded = load_config(path=path, env={})
    llama = loaded.config.backend.llama
    assert llama.aliases == ["gpt-4o", "test"]
    assert [m.aliases for m in llama.models] == [("small",), ()]
    # A table's settings do not inherit the default model's aliases.
    assert llama.models[0].settings(llama).aliases == []
    entries = create_models(loaded.config)
    assert [(e.name, e.aliases) for e in entries] == [
        ("gemma", ("gpt-4o", "test")),
        ("tiny", ("small",)),
        ("coder", ()),
    ]
    assert main(["config", "show", "--config", str(path)]) == 0
    shown = tomllib.loads(re.sub(r"#.*", "", capsys.readouterr().out))["backend"]
    assert shown["llama"]["aliases"] == ["gpt-4o", "test"]
    assert shown["llama"]["models"][0]["aliases"] == ["small"]
    assert shown["fake"]["aliases"] == [] and shown["openai"]["aliases"] == []
    fake = load_config(env={}, overrides={"backend.kind": "fake", "backend.fake.aliases": ["m"]})
    assert [(e.name, e.aliases) for e in create_models(fake.config)] == [("fake", ("m",))]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend.llama.aliases": ["bad name"]}, "backend.llama.aliases (from flag): 'bad name'"),
        ({"backend.llama.aliases": ["a", "a"]}, "backend.llama.aliases (from flag): 'a' is listed"),
        ({"backend.fake.aliases": [""]}, "backend.fake.aliases (from flag): '' is not a model"),
        (
            {"backend.llama.models": [{"name": "a", "model": "x", "aliases": "b"}]},
            "backend.llama.models[0].aliases (from flag): expected a list of strings",
        ),
        (
            {"backend.kind": "openai", "backend.openai.aliases": ["gpt-4o"]},
            "backend.openai.aliases (from flag): aliases name backend.openai.model, and none",
        ),
    ],
)
def test_bad_aliases_are_refused_naming_the_key(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(env={}, overrides=overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {
                "backend.llama.model": "/m/gemma.gguf",
                "backend.llama.aliases": ["small"],
                "backend.llama.models": [{"name": "a", "model": "x", "aliases": ["small"]}],
            },
            "backend.llama.models[0]: the alias 'small' is already a name of model 'gemma'",
        ),
        (
            {
                "backend.llama.model": "/m/gemma.gguf",
                "backend.llama.aliases": ["a"],
                "backend.llama.models": [{"name": "a", "model": "x"}],
            },
            "backend.llama.models[0]: the model name 'a' is already an alias of model 'gemma'",
        ),
        (
            {"backend.llama.models": [{"name": "a", "model": "x", "aliases": ["a"]}]},
            "backend.llama.models[0]: the alias 'a' is the model's own name",
        ),
        (
            {
                "backend.llama.models": [
                    {"name": "a", "model": "x"},
                    {"name": "b", "model": "y", "aliases": ["a"]},
                ]
            },
            "backend.llama.models[1]: the alias 'a' is already a name of model 'a'",
        ),
        (
            {
                "backend.llama.aliases": ["x"],
                "backend.llama.models": [{"name": "a", "model": "x"}],
            },
            "backend.llama.aliases: they name backend.llama.model, and none is served",
        ),
    ],
)
def test_an_alias_that_clashes_with_another_name_is_a_config_error(
    overrides: dict[str, object], message: str
) -> None:
    from wsserver.backends import create_models

    config = load_config(env={}, overrides=overrides).config
    with pytest.raises(ConfigError, match=re.escape(message)):
        create_models(config)

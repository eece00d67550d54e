"""SigLIP projectors (``gemma3``, ``idefics3``) checked from their header.

Each malformed file here was given to libmtmd once, without the check
(``mtmd_init_from_file`` in a child process): a missing ``attn_q``,
``attn_k``, ``attn_v`` in any layer or ``v.patch_embd.weight`` is a SIGSEGV
(exit 139) in the warm-up encode; an idefics3 file without
``projector.scale_factor`` and a per-head norm of the wrong size abort it
(``GGML_ASSERT``, exit 134); a missing ``v.position_embd.weight``, a
``projector.scale_factor`` that does not divide the patches, a fused
``attn_qkv`` or an idefics3 file without ``preproc_image_size`` *load* — and
then run a graph, or a token count, the file's model was not made for.
Each is refused here, by name, before libmtmd sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import TINY_MODEL, refuses_to_load_then_serves, running_server, wire
from test_llama_backend import llama_config
from test_ollama_http import host
from tiny_gguf import write_tiny_gguf
from tiny_mmproj import write_tiny_mmproj
from tiny_siglip import GEMMA3_TOKENS, IDEFICS3_TILE_TOKENS, IDEFICS3_TOKENS, write_tiny_siglip

from wsserver.backends.mmproj_check import CHECKED_TYPES, ProjectorError, check_projector

BOTH = {
    "v.blk.0.attn_q.weight": "tensor v.blk.0.attn_q.weight",
    "v.blk.1.attn_k.weight": "tensor v.blk.1.attn_k.weight",  # every layer runs
    "v.blk.1.attn_v.weight": "tensor v.blk.1.attn_v.weight",
    "v.blk.1.ffn_up.weight": "tensor v.blk.1.ffn_up.weight",
    "v.patch_embd.weight": "tensor v.patch_embd.weight",
    "v.position_embd": "tensor v.position_embd.weight",
    "clip.vision.image_std": "metadata clip.vision.image_std",
    "clip.vision.block_count": "metadata clip.vision.block_count",
    "clip.vision.attention.layer_norm_epsilon": "layer_norm_epsilon",
}
MISSING = {
    "gemma3": {
        **BOTH,
        "mm.soft_emb_norm": "tensor mm.soft_emb_norm.weight",
        "mm.input_projection": "tensor mm.input_projection.weight",
    },
    "idefics3": {
        **BOTH,
        "mm.model.fc": "tensor mm.model.fc.weight",
        "clip.vision.projector.scale_factor": "metadata clip.vision.projector.scale_factor",
        "clip.vision.preproc_image_size": "metadata clip.vision.preproc_image_size",
    },
}
CASES = [(kind, omit) for kind, table in MISSING.items() for omit in sorted(table)]


@pytest.mark.parametrize("kind", ["gemma3", "idefics3"])
def test_the_tiny_projectors_pass_and_say_what_they_take(tmp_path: Path, kind: str) -> None:
    projector = check_projector(write_tiny_siglip(tmp_path / "p.gguf", kind), text_width=64)
    assert (projector.projector_type, projector.vision, projector.audio) == (kind, True, False)
    assert projector.output_width == 64 and projector.merge == 2
    tokens = GEMMA3_TOKENS if kind == "gemma3" else IDEFICS3_TILE_TOKENS
    assert projector.image_tokens == tokens
    assert kind in CHECKED_TYPES


def test_gemma3s_pooling_defaults_to_four_as_libmtmd_does(tmp_path: Path) -> None:
    # Real Gemma 3 files say no scale factor: 64 x 64 patches pooled 4 x 4.
    path = write_tiny_siglip(tmp_path / "p.gguf", "gemma3", scale_factor=None)
    projector = check_projector(path, text_width=64)
    assert (projector.merge, projector.image_tokens) == (4, 4)


@pytest.mark.parametrize(("kind", "omit"), CASES)
def test_each_missing_piece_is_refused_by_name(tmp_path: Path, kind: str, omit: str) -> None:
    path = write_tiny_siglip(tmp_path / "p.gguf", kind, omit=(omit,))
    with pytest.raises(ProjectorError) as refused:
        check_projector(path, text_width=64)
    assert MISSING[kind][omit] in str(refused.value)


def test_every_missing_piece_is_named_at_once(tmp_path: Path) -> None:
    omit = ("mm.input_projection", "v.blk.0.attn_q.weight", "v.blk.1.attn_v.weight")
    path = write_tiny_siglip(tmp_path / "p.gguf", "gemma3", omit=omit)
    with pytest.raises(ProjectorError) as refused:
        check_projector(path)
    for name in ("mm.input_projection.weight", "v.blk.0.attn_q.weight", "v.blk.1.attn_v.weight"):
        assert name in str(refused.value)


#: (kind, what the builder is given, what the refusal says)
MALFORMED: dict[str, tuple[str, dict[str, Any], str]] = {
    "a fused attention": (
        "gemma3",
        {"extra": {"v.blk.0.attn_qkv.weight": (96, 32)}},
        "tensor v.blk.0.attn_qkv.weight (not one a gemma3 projector has here)",
    ),
    "a per-head norm": (
        "gemma3",
        {"extra": {"v.blk.0.attn_q_norm.weight": (5,)}},
        "tensor v.blk.0.attn_q_norm.weight (not one",
    ),
    "a class embedding": ("idefics3", {"extra": {"v.class_embd": (32,)}}, "tensor v.class_embd"),
    "a pool that drops patches": (
        "gemma3",
        {"scale_factor": 3},
        "8 patches a side are not a multiple of clip.vision.projector.scale_factor 3",
    ),
    "a shuffle that pads": (
        "idefics3",
        {"scale_factor": 3},
        "4 patches a side are not a multiple",
    ),
    "a shuffle of one": (
        "idefics3",
        {"scale_factor": 1},
        "clip.vision.projector.scale_factor = 1 (at least 2)",
    ),
    "a norm of the wrong width": (
        "gemma3",
        {"omit": ("mm.soft_emb_norm",), "extra": {"mm.soft_emb_norm.weight": (31,)}},
        "tensor mm.soft_emb_norm.weight is 31, not 32",
    ),
    "a projection taking the wrong width": (
        "gemma3",
        {"omit": ("mm.input_projection",), "extra": {"mm.input_projection.weight": (31, 64)}},
        "tensor mm.input_projection.weight is 64x31, not *x32",
    ),
    "a position table short of rows": (
        "idefics3",
        {"omit": ("v.position_embd",), "extra": {"v.position_embd.weight": (12, 32)}},
        "tensor v.position_embd.weight is 32x12, not 32x16",
    ),
    "an fc layer not sized for the shuffle": (
        "idefics3",
        {"omit": ("mm.model.fc",), "extra": {"mm.model.fc.weight": (64, 32)}},
        "tensor mm.model.fc.weight is 32x64, not 128x*",
    ),
    "grouped heads": (
        "gemma3",
        {"meta": {"clip.vision.attention.head_count_kv": 2}},
        "metadata clip.vision.attention.head_count_kv = 2, not 4",
    ),
    "heads of another size": (
        "idefics3",
        {"meta": {"clip.vision.attention.head_dim": 16}},
        "metadata clip.vision.attention.head_dim = 16, not 8",
    ),
    "a grid of 32 x 32 slices": (
        "idefics3",
        {"meta": {"clip.vision.preproc_image_size": 1024}},
        "a grid of 32 slices a side (at most 8 taken here)",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_tensor_or_a_factor_the_graph_would_misuse_is_refused(tmp_path: Path, case: str) -> None:
    kind, given, said = MALFORMED[case]
    path = write_tiny_siglip(tmp_path / "p.gguf", kind, **given)
    with pytest.raises(ProjectorError) as refused:
        check_projector(path, text_width=64)
    assert said in str(refused.value)


def test_misshapen_tensors_and_a_wrong_width_are_refused(tmp_path: Path) -> None:
    # The projection's output is 48 wide: not the text model's 64.
    narrow = write_tiny_siglip(tmp_path / "n.gguf", "gemma3", text_width=48)
    with pytest.raises(ProjectorError, match="output width 48 is not the text model's"):
        check_projector(narrow, text_width=64)
    narrow = write_tiny_siglip(tmp_path / "i.gguf", "idefics3", text_width=48)
    with pytest.raises(ProjectorError, match="output width 48 is not the text model's"):
        check_projector(narrow, text_width=64)


def test_an_m_rope_type_is_refused_saying_so(tmp_path: Path) -> None:
    for name, mrope in (("qwen2vl_merger", True), ("qwen2.5vl_merger", True), ("pixtral", False)):
        path = write_tiny_mmproj(tmp_path / f"{name}.gguf", projector_type=name)
        with pytest.raises(ProjectorError) as refused:
            check_projector(path)
        message = str(refused.value)
        assert f"projector type {name!r} is not one wsserver checks" in message
        assert "mlp, gemma3, idefics3" in message
        assert ("M-RoPE" in message) is mrope


# ---------------------------------------------------------------- the server


async def test_malformed_siglip_projectors_fail_their_loads_and_the_server_serves_on(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    # Given to libmtmd, the first is a SIGSEGV and the second a GGML_ASSERT
    # abort (above): the test process would die.
    pytest.importorskip("llama_cpp.mtmd_cpp")
    gemma = write_tiny_siglip(tmp_path / "g.gguf", "gemma3", omit=("v.blk.0.attn_q.weight",))
    smol = write_tiny_siglip(tmp_path / "s.gguf", "idefics3", scale_factor=None)
    config = llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[
            {"name": "gemma", "model": str(tiny_gguf), "mmproj": str(gemma)},
            {"name": "smol", "model": str(tiny_gguf), "mmproj": str(smol)},
        ],
    )
    async with running_server(config) as server, wire(server) as client:
        await refuses_to_load_then_serves(
            server,
            client,
            str(tmp_path),
            {
                "gemma": "tensor v.blk.0.attn_q.weight",
                "smol": "metadata clip.vision.projector.scale_factor",
            },
        )


async def test_gemma3_and_idefics3_models_say_they_take_images(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp")
    smol_text = write_tiny_gguf(tmp_path / "smol.gguf", extra_tokens=IDEFICS3_TOKENS)
    gemma = write_tiny_siglip(tmp_path / "gemma.mmproj.gguf", "gemma3")
    smol = write_tiny_siglip(tmp_path / "smol.mmproj.gguf", "idefics3")
    config = llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[
            {"name": "gemma", "model": str(tiny_gguf), "mmproj": str(gemma), "preload": True},
            {"name": "smol", "model": str(smol_text), "mmproj": str(smol), "preload": True},
        ],
    )
    async with running_server(config) as server:
        async with aiohttp.ClientSession() as session:
            async with session.get(host(server) + "/v1/models") as response:
                listed = {m["id"]: m for m in (await response.json())["data"]}
        assert listed["gemma"]["input_modalities"] == ["text", "image"]
        assert listed["smol"]["input_modalities"] == ["text", "image"]
        assert listed[TINY_MODEL]["input_modalities"] == ["text"]

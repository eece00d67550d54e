"""A vision projector is checked from its header before libmtmd sees it.

libmtmd's warm-up encode inside ``mtmd_init_from_file`` dereferences the
tensors a projector lacks: tried here, a projector without ``mm.2.*``,
``mm.0.*``, ``v.position_embd.weight``, ``v.patch_embd.weight`` or the first
layer's ``attn_q`` kills the process (SIGSEGV). Each is refused by
:func:`wsserver.backends.mmproj_check.check_projector`, by name, and a server
asked for such a model answers ``model_load_failed`` and goes on serving its
other models.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import gguf
import numpy as np
import pytest
from conftest import TINY_MODEL, refuses_to_load_then_serves, running_server, wire
from test_llama_backend import llama_config
from test_ollama_http import async_client, host
from tiny_gguf import write_tiny_gguf
from tiny_mmproj import IMAGE_TOKENS, write_tiny_mmproj

from wsserver.backends.mmproj_check import ProjectorError, check_projector

#: Each of these, missing, crashed libmtmd (exit 139) or failed its load.
MISSING = {
    "mm.2": "tensor mm.2.weight",
    "mm.2.bias": "tensor mm.2.bias",
    "mm.0.weight": "tensor mm.0.weight",
    "mm.0.bias": "tensor mm.0.bias",
    "v.position_embd": "tensor v.position_embd.weight",
    "v.patch_embd.weight": "tensor v.patch_embd.weight",
    "v.blk.0.attn_q.weight": "tensor v.blk.0.attn_q.weight",
    "v.blk.0.attn_k.weight": "tensor v.blk.0.attn_k.weight",
    "v.blk.0.attn_out.weight": "tensor v.blk.0.attn_out.weight",
    "v.blk.1.ffn_down.weight": "tensor v.blk.1.ffn_down.weight",
    "clip.vision.image_mean": "metadata clip.vision.image_mean",
    "clip.vision.patch_size": "metadata clip.vision.patch_size",
    "clip.vision.embedding_length": "metadata clip.vision.embedding_length",
    "clip.has_vision_encoder": "clip.has_vision_encoder is not true",
    "clip.projector_type": "no clip.projector_type",
}


def test_the_tiny_projector_passes_and_says_what_it_takes(tmp_path: Path) -> None:
    projector = check_projector(write_tiny_mmproj(tmp_path / "p.gguf"), text_width=64)
    assert (projector.projector_type, projector.vision, projector.audio) == ("mlp", True, False)
    assert projector.image_tokens == IMAGE_TOKENS == 16
    assert projector.output_width == 64


@pytest.mark.parametrize("omit", sorted(MISSING))
def test_each_missing_piece_is_refused_by_name(tmp_path: Path, omit: str) -> None:
    path = write_tiny_mmproj(tmp_path / "p.gguf", omit=(omit,))
    with pytest.raises(ProjectorError) as refused:
        check_projector(path, text_width=64)
    assert MISSING[omit] in str(refused.value)


def test_every_missing_piece_is_named_at_once(tmp_path: Path) -> None:
    path = write_tiny_mmproj(tmp_path / "p.gguf", omit=("mm.2", "v.position_embd"))
    with pytest.raises(ProjectorError) as refused:
        check_projector(path)
    message = str(refused.value)
    for name in ("mm.2.weight", "mm.2.bias", "v.position_embd.weight"):
        assert name in message


def test_a_layer_the_graph_does_not_run_may_lack_its_attention(tmp_path: Path) -> None:
    # The llava graph runs block_count - 1 layers: libmtmd never reads the
    # last layer's attn_q, so a file without it is not refused.
    path = write_tiny_mmproj(tmp_path / "p.gguf", omit=("v.blk.1.attn_q.weight",))
    assert check_projector(path, text_width=64).image_tokens == 16


def test_an_unknown_type_a_wrong_width_and_a_text_model_are_refused(tmp_path: Path) -> None:
    other = write_tiny_mmproj(tmp_path / "g.gguf", projector_type="pixtral")
    with pytest.raises(ProjectorError, match="projector type 'pixtral' is not one wsserver checks"):
        check_projector(other)
    good = write_tiny_mmproj(tmp_path / "p.gguf")
    with pytest.raises(ProjectorError, match=r"output width 64 is not .* width 128"):
        check_projector(good, text_width=128)
    text = write_tiny_gguf(tmp_path / "t.gguf")
    with pytest.raises(ProjectorError, match="not a projector"):
        check_projector(text)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ProjectorError, match="ends inside"):
        check_projector(tmp_path / "junk.gguf")


def test_a_misshapen_tensor_is_refused(tmp_path: Path) -> None:
    path = write_tiny_mmproj(tmp_path / "p.gguf", text_width=48)  # mm.2: 48 wide
    with pytest.raises(ProjectorError, match="output width 48 is not the text model's"):
        check_projector(path, text_width=64)


#: Each of these, misshapen, aborted the process in libmtmd's warm-up
#: (GGML_ASSERT, exit 134: a product or a sum of mismatched shapes).
MISSHAPEN = {
    "v.blk.0.ffn_up.weight": (64, 33),
    "v.blk.0.ffn_down.weight": (30, 64),
    "v.blk.0.ffn_up.bias": (65,),
    "v.blk.0.attn_q.bias": (31,),
    "v.blk.0.ln1.weight": (30,),
    "v.patch_embd.bias": (31,),
}


@pytest.mark.parametrize("name", sorted(MISSHAPEN))
def test_each_misshapen_tensor_is_refused_by_name(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_tensor = gguf.GGUFWriter.add_tensor

    def misshapen(self: gguf.GGUFWriter, tensor: str, values: Any, *args: Any, **kw: Any) -> None:
        if tensor == name:
            values = np.full(MISSHAPEN[name], 0.01, dtype=np.float32)
        add_tensor(self, tensor, values, *args, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", misshapen)
    path = write_tiny_mmproj(tmp_path / "p.gguf")
    with pytest.raises(ProjectorError, match=re.escape(name.rsplit(".", 1)[0])):
        check_projector(path, text_width=64)


# ---------------------------------------------------------------- the server


async def test_a_malformed_projector_fails_its_models_load_and_the_server_serves_on(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp")
    broken = write_tiny_mmproj(tmp_path / "broken.gguf", omit=("mm.2", "v.position_embd"))
    unknown = write_tiny_mmproj(tmp_path / "unknown.gguf", projector_type="qwen2vl_merger")
    config = llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[
            {"name": "broken", "model": str(tiny_gguf), "mmproj": str(broken)},
            {"name": "unknown", "model": str(tiny_gguf), "mmproj": str(unknown)},
        ],
    )
    async with running_server(config) as server, wire(server) as client:
        await refuses_to_load_then_serves(
            server, client, str(tmp_path), {"broken": "mm.2.weight", "unknown": "'qwen2vl_merger'"}
        )


async def test_a_vision_model_says_it_takes_images_everywhere_a_model_is_described(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp.mtmd_cpp")
    mmproj = write_tiny_mmproj(tmp_path / "seer.mmproj.gguf")
    config = llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[
            {"name": "seer", "model": str(tiny_gguf), "mmproj": str(mmproj), "preload": True}
        ],
    )
    async with running_server(config) as server:
        async with wire(server) as client:
            described = {m["name"]: m for m in client.hello["models"]}
        assert described[TINY_MODEL]["input_modalities"] == ["text"]
        assert described["seer"]["input_modalities"] == ["text", "image"]
        async with aiohttp.ClientSession() as session:
            async with session.get(host(server) + "/v1/models") as response:
                listed = {m["id"]: m for m in (await response.json())["data"]}
        assert listed["seer"]["input_modalities"] == ["text", "image"]
        assert listed[TINY_MODEL]["input_modalities"] == ["text"]
        async with async_client(server) as ollama:
            shown = await ollama.show("seer")
            plain = await ollama.show(TINY_MODEL)
        assert shown.capabilities is not None and "vision" in shown.capabilities
        assert plain.capabilities is not None and "vision" not in plain.capabilities


def test_a_projector_is_its_models_alone_and_no_model_of_its_own(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    from conftest import make_config

    from wsserver.backends import create_models
    from wsserver.backends.llama import LlamaBackend

    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_gguf(folder / "other.gguf")
    write_tiny_mmproj(folder / "other.mmproj.gguf")  # beside it: not listed as a model
    mmproj = write_tiny_mmproj(tmp_path / "seer.mmproj.gguf")
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__mmproj=str(mmproj),
        backend__llama__models_dir=str(folder),
        backend__llama__models=[{"name": "plain", "model": str(tiny_gguf)}],
    )
    entries = {entry.name: entry.backend for entry in create_models(config)}
    assert sorted(entries) == ["other", "plain", TINY_MODEL]
    projectors = {name: b.mmproj for name, b in entries.items() if isinstance(b, LlamaBackend)}
    assert projectors == {TINY_MODEL: str(mmproj), "plain": "", "other": ""}


def test_a_projector_cut_short_passes_the_header_check_and_libmtmd_refuses_it(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    # The header is whole, the tensor data is not: libmtmd fails to seek for
    # the first missing tensor and returns no context (tried here: no crash).
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from wsserver.backends.llama import LlamaBackend
    from wsserver.errors import ModelLoadError

    path = write_tiny_mmproj(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:60_000])
    check_projector(path, text_width=64)  # the header says nothing is missing
    backend = LlamaBackend(model=str(tiny_gguf), mmproj=str(path), n_threads=1, n_ctx=256)
    with pytest.raises(ModelLoadError, match="libmtmd could not load it"):
        backend.load()
    assert backend.vision is None and backend.engine is None


def test_a_quantized_convolution_kernel_is_refused_and_quantized_matrices_load(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    # Tried here: a Q8_0 patch-embedding kernel aborts the process inside
    # mtmd_init_from_file (GGML_ASSERT, exit 134). Patches of 32 pixels: a
    # kernel row of 32 values, which Q8_0 can hold at all.
    q8 = gguf.GGMLQuantizationType.Q8_0
    wide = {"image_size": 64, "patch_size": 32}
    kernel = write_tiny_mmproj(tmp_path / "k.gguf", quantize={"v.patch_embd.weight": q8}, **wide)
    with pytest.raises(ProjectorError, match=r"tensor v\.patch_embd\.weight has ggml type 8"):
        check_projector(kernel, text_width=64)
    bias = write_tiny_mmproj(
        tmp_path / "b.gguf", quantize={"v.blk.0.attn_q.bias": q8, "mm.0.weight": q8}
    )
    with pytest.raises(ProjectorError, match=r"tensor v\.blk\.0\.attn_q\.bias has ggml type 8"):
        check_projector(bias, text_width=64)
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from wsserver.backends.llama import LlamaBackend

    matrices = {"mm.0.weight": q8, "v.blk.0.attn_q.weight": q8, "v.position_embd.weight": q8}
    quantized = write_tiny_mmproj(tmp_path / "q.gguf", quantize=matrices)
    assert check_projector(quantized, text_width=64).image_tokens == IMAGE_TOKENS
    backend = LlamaBackend(model=str(tiny_gguf), mmproj=str(quantized), n_threads=1, n_ctx=256)
    backend.load()
    try:
        assert backend.input_modalities() == ("text", "image")
    finally:
        backend.close()


def test_a_header_claiming_a_huge_warm_up_is_refused(tmp_path: Path) -> None:
    # 1024 px in patches of 8: 16,384 patches, whose attention scores the
    # warm-up would allocate (patches² per head; a real claim can be far larger).
    path = write_tiny_mmproj(tmp_path / "p.gguf", image_size=1024, patch_size=8)
    with pytest.raises(ProjectorError, match="16384 patches"):
        check_projector(path, text_width=64)

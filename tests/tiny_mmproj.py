"""A tiny random-weight vision projector GGUF (LLaVA-style ``mlp``) for tests.

It pairs with :func:`tiny_gguf.write_tiny_gguf` (a llama text model of
width 64): libmtmd (``llama_cpp.mtmd_cpp``) loads it, runs its warm-up encode
and turns a 32 x 32 image into 16 embeddings of width 64 that the text model
decodes like tokens. No real vision weights can be downloaded here, so this is
how the tests prove the image plumbing is real: the weights are random
(seeded) but the graph is libmtmd's own llava graph (``tools/mtmd/models/
llava.cpp``), so an image changes the model's greedy output and the same image
gives the same output.

The layout (names from ``tools/mtmd/clip-impl.h``; numpy ``(rows, cols)`` is
ggml ``ne = [cols, rows]``, ``cols`` the input width):

- metadata: ``general.architecture = "clip"``, ``clip.has_vision_encoder``,
  ``clip.projector_type = "mlp"``, ``clip.vision.{embedding_length 32,
  feed_forward_length 64, block_count 2, projection_dim 64,
  attention.head_count 4, attention.layer_norm_epsilon, image_size 32,
  patch_size 8, image_mean, image_std}`` — ``image_mean``/``image_std`` are
  required (libmtmd refuses a projector without three of each);
- ``v.patch_embd.weight`` (a conv kernel: ``ne = [8, 8, 3, 32]``) and its
  bias; ``v.position_embd.weight`` (one row per patch: 16 x 32);
- per vision layer ``v.blk.{i}``: ``attn_q``/``attn_k``/``attn_v``/``attn_out``
  (weight and bias), ``ln1``/``ln2`` (layer norms), ``ffn_up`` (32 → 64) and
  ``ffn_down`` (64 → 32); the llava graph runs ``block_count - 1`` of them (it
  takes the second-to-last layer's output, as LLaVA does);
- the projector ``mm.0`` (32 → 64, then GELU) and ``mm.2`` (64 → 64): its
  output width must be the text model's width, or libmtmd refuses the pair.

(32 / 8)² = 16 image tokens per image. Nothing is committed: tests write the
file into a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

__all__ = ["IMAGE_TOKENS", "add_tiny_vision", "write_tiny_mmproj"]

IMAGE_SIZE = 32
PATCH_SIZE = 8
#: Image tokens libmtmd makes of one image for this projector.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2


def write_tiny_mmproj(
    path: str | Path,
    *,
    text_width: int = 64,
    width: int = 32,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 64,
    seed: int = 4321,
    omit: tuple[str, ...] = (),
    projector_type: str = "mlp",
    image_size: int = IMAGE_SIZE,
    patch_size: int = PATCH_SIZE,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write the tiny projector to ``path`` and return it (about 120 KB).

    ``text_width`` is the paired text model's embedding width (the
    projector's output width). ``omit`` leaves out every tensor or metadata
    key whose name starts with one of its entries — how the tests build the
    malformed projectors that must be refused before libmtmd sees them;
    ``quantize`` stores the named tensors in those ggml types instead of F32.
    """
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name("wsserver-tiny-test-mmproj")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tiny_vision(
        writer,
        text_width=text_width,
        width=width,
        n_layer=n_layer,
        n_head=n_head,
        n_ff=n_ff,
        seed=seed,
        omit=omit,
        projector_type=projector_type,
        image_size=image_size,
        patch_size=patch_size,
        quantize=quantize,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tiny_vision(
    writer: gguf.GGUFWriter,
    *,
    text_width: int = 64,
    width: int = 32,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 64,
    seed: int = 4321,
    omit: tuple[str, ...] = (),
    projector_type: str = "mlp",
    image_size: int = IMAGE_SIZE,
    patch_size: int = PATCH_SIZE,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """The tiny projector's metadata and tensors, into ``writer`` (see
    :func:`write_tiny_mmproj`; ``tests/tiny_audio.py`` adds them beside an
    audio encoder's)."""
    rng = np.random.default_rng(seed)
    n_patches = (image_size // patch_size) ** 2
    quantize = quantize or {}

    def kept(name: str) -> bool:
        return not any(name.startswith(prefix) for prefix in omit)

    scalars: list[tuple[str, object]] = [
        ("clip.has_vision_encoder", True),
        ("clip.has_audio_encoder", False),
        ("clip.projector_type", projector_type),
        ("clip.use_gelu", True),
        ("clip.vision.embedding_length", width),
        ("clip.vision.feed_forward_length", n_ff),
        ("clip.vision.block_count", n_layer),
        ("clip.vision.projection_dim", text_width),
        ("clip.vision.attention.head_count", n_head),
        ("clip.vision.attention.layer_norm_epsilon", 1e-6),
        ("clip.vision.image_size", image_size),
        ("clip.vision.patch_size", patch_size),
        ("clip.vision.image_mean", [0.5, 0.5, 0.5]),
        ("clip.vision.image_std", [0.5, 0.5, 0.5]),
    ]
    for key, value in scalars:
        if not kept(key):
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, value)  # type: ignore[arg-type]

    def tensor(name: str, shape: tuple[int, ...], scale: float) -> None:
        if kept(name):
            values = (rng.standard_normal(shape) * scale).astype(np.float32)
            kind = quantize.get(name)
            if kind is None:
                writer.add_tensor(name, values)
            else:
                writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    def norm(name: str, size: int) -> None:
        if kept(name + ".weight"):
            weight = 1.0 + 0.1 * rng.standard_normal(size)
            writer.add_tensor(name + ".weight", weight.astype(np.float32))
        if kept(name + ".bias"):
            writer.add_tensor(name + ".bias", np.zeros(size, dtype=np.float32))

    tensor("v.patch_embd.weight", (width, 3, patch_size, patch_size), 0.2)
    tensor("v.patch_embd.bias", (width,), 0.1)
    tensor("v.position_embd.weight", (n_patches, width), 0.5)
    for layer in range(n_layer):
        prefix = f"v.blk.{layer}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"{prefix}.{part}.weight", (width, width), 0.3)
            tensor(f"{prefix}.{part}.bias", (width,), 0.05)
        norm(f"{prefix}.ln1", width)
        norm(f"{prefix}.ln2", width)
        tensor(f"{prefix}.ffn_up.weight", (n_ff, width), 0.3)
        tensor(f"{prefix}.ffn_up.bias", (n_ff,), 0.05)
        tensor(f"{prefix}.ffn_down.weight", (width, n_ff), 0.3)
        tensor(f"{prefix}.ffn_down.bias", (width,), 0.05)
    # Large enough that the image's embeddings move the text model's output.
    tensor("mm.0.weight", (text_width, width), 0.5)
    tensor("mm.0.bias", (text_width,), 0.1)
    tensor("mm.2.weight", (text_width, text_width), 0.5)
    tensor("mm.2.bias", (text_width,), 0.1)

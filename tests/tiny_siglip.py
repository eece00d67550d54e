"""Tiny random-weight SigLIP projector GGUFs (``gemma3``, ``idefics3``) for tests.

Like :mod:`tiny_mmproj` (LLaVA's ``mlp``), they pair with
:func:`tiny_gguf.write_tiny_gguf` (a llama text model of width 64): libmtmd
loads them, runs their warm-up encode and turns an image into embeddings of
width 64 through its own SigLIP graph (``tools/mtmd/models/siglip.cpp``).
The weights are random (seeded); the graph is libmtmd's.

Both: ``general.architecture = "clip"``, ``clip.has_vision_encoder``,
``clip.vision.{embedding_length 32, feed_forward_length 64, block_count 2,
projection_dim 64, attention.head_count 4, attention.layer_norm_epsilon,
image_size, patch_size 8, image_mean, image_std, projector.scale_factor 2}``;
``v.patch_embd.weight`` (``ne = [8, 8, 3, 32]``) and bias,
``v.position_embd.weight`` (one row per patch), per layer ``v.blk.{i}``
``attn_q/attn_k/attn_v/attn_out`` (weight, bias), ``ln1``, ``ln2``,
``ffn_up`` (32 → 64), ``ffn_down`` (64 → 32) — the SigLIP graph runs every
layer —, and ``v.post_ln``. Then:

- ``gemma3``: images of 64 x 64, 8 x 8 patches, pooled 2 x 2 → **16 image
  tokens**, attended non-causally by the text model;
  ``mm.soft_emb_norm.weight`` (32) and ``mm.input_projection.weight``
  (``ne = [64, 32]``: multiplied transposed).
- ``idefics3``: tiles of 32 x 32, 4 x 4 patches, shuffled 2 x 2 → **4
  tokens a tile**; ``clip.vision.preproc_image_size = 64``: an image is an
  overview and 2 x 2 slices (20 image tokens, with marker text between);
  ``mm.model.fc.weight`` (``ne = [128, 64]``). Its text model needs the
  markers' tokens in its vocabulary: :data:`IDEFICS3_TOKENS`.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tiny_mmproj import TinyTensors, clip_writer, finish

__all__ = ["GEMMA3_TOKENS", "IDEFICS3_TILE_TOKENS", "IDEFICS3_TOKENS", "write_tiny_siglip"]

#: Image tokens libmtmd makes of one image for the tiny gemma3 projector.
GEMMA3_TOKENS = 16
#: ... and of one tile (the overview or a slice) for the tiny idefics3 one.
IDEFICS3_TILE_TOKENS = 4
#: The text the idefics3 template puts around tiles, looked up by libmtmd
#: as single tokens of the text model's vocabulary.
IDEFICS3_TOKENS: tuple[tuple[str, gguf.TokenType], ...] = (
    ("\n\n", gguf.TokenType.USER_DEFINED),
    ("<fake_token_around_image>", gguf.TokenType.USER_DEFINED),
    ("<global-img>", gguf.TokenType.USER_DEFINED),
)

_SIZES = {"gemma3": 64, "idefics3": 32}


def write_tiny_siglip(
    path: str | Path,
    kind: str,
    *,
    text_width: int = 64,
    width: int = 32,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 64,
    seed: int = 2468,
    omit: tuple[str, ...] = (),
    extra: dict[str, tuple[int, ...]] | None = None,
    meta: dict[str, int] | None = None,
    scale_factor: int | None = 2,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write a tiny ``kind`` projector (``gemma3`` or ``idefics3``) to ``path``.

    ``omit`` leaves out every tensor or metadata key whose name starts with
    one of its entries; ``extra`` adds tensors (name: numpy shape) and
    ``meta`` integer metadata (in place of the builder's own);
    ``scale_factor`` None writes no ``projector.scale_factor``; ``quantize``
    stores the named tensors in those ggml types instead of F32.
    """
    path = Path(path)
    image_size, patch_size = _SIZES[kind], 8
    n_patches = (image_size // patch_size) ** 2
    writer = clip_writer(path, f"wsserver-tiny-test-{kind}")
    out = TinyTensors(writer, np.random.default_rng(seed), omit, quantize)
    scalars: list[tuple[str, object]] = [
        ("clip.has_vision_encoder", True),
        ("clip.has_audio_encoder", False),
        ("clip.projector_type", kind),
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
    if scale_factor is not None:
        scalars.append(("clip.vision.projector.scale_factor", scale_factor))
    if kind == "idefics3":
        scalars.append(("clip.vision.preproc_image_size", 2 * image_size))
    meta = meta or {}
    scalars = [(key, value) for key, value in scalars if key not in meta] + list(meta.items())
    out.metadata(scalars)

    out.tensor("v.patch_embd.weight", (width, 3, patch_size, patch_size), 0.2)
    out.tensor("v.patch_embd.bias", (width,), 0.1)
    out.tensor("v.position_embd.weight", (n_patches, width), 0.5)
    for layer in range(n_layer):
        out.encoder_layer(f"v.blk.{layer}", width, n_ff)
    out.norm("v.post_ln", width)
    # Large enough that the image's embeddings move the text model's output.
    if kind == "gemma3":
        if out.kept("mm.soft_emb_norm.weight"):
            weight = 1.0 + 0.1 * out.rng.standard_normal(width)
            writer.add_tensor("mm.soft_emb_norm.weight", weight.astype(np.float32))
        out.tensor("mm.input_projection.weight", (width, text_width), 0.5)
    else:
        merged = width * (scale_factor or 1) ** 2
        out.tensor("mm.model.fc.weight", (text_width, merged), 0.5)
    for name, shape in (extra or {}).items():  # (whatever ``omit`` says)
        writer.add_tensor(name, (out.rng.standard_normal(shape) * 0.1).astype(np.float32))

    return finish(writer, path)

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

__all__ = [
    "IMAGE_TOKENS",
    "TinyTensors",
    "add_tiny_vision",
    "clip_writer",
    "finish",
    "write_tiny_mmproj",
]

IMAGE_SIZE = 32
PATCH_SIZE = 8
#: Image tokens libmtmd makes of one image for this projector.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2


class TinyTensors:
    """Metadata and seeded random tensors into a projector GGUF's writer,
    leaving out every name that starts with one of ``omit`` (how the tests
    build malformed projectors) and storing the names in ``quantize`` in
    those ggml types: what every tiny projector builder here shares."""

    def __init__(
        self,
        writer: gguf.GGUFWriter,
        rng: np.random.Generator,
        omit: tuple[str, ...] = (),
        quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    ) -> None:
        self.writer, self.rng, self.omit = writer, rng, omit
        self.quantize = quantize or {}

    def kept(self, name: str) -> bool:
        return not any(name.startswith(prefix) for prefix in self.omit)

    def metadata(self, items: list[tuple[str, object]]) -> None:
        for key, value in items:
            if not self.kept(key):
                continue
            if isinstance(value, bool):
                self.writer.add_bool(key, value)
            elif isinstance(value, str):
                self.writer.add_string(key, value)
            elif isinstance(value, int):
                self.writer.add_uint32(key, value)
            elif isinstance(value, float):
                self.writer.add_float32(key, value)
            else:
                self.writer.add_array(key, value)  # type: ignore[arg-type]

    def tensor(self, name: str, shape: tuple[int, ...], scale: float) -> None:
        if self.kept(name):
            values = (self.rng.standard_normal(shape) * scale).astype(np.float32)
            kind = self.quantize.get(name)
            if kind is None:
                self.writer.add_tensor(name, values)
            else:
                self.writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    def norm(self, name: str, size: int, bias: bool = True) -> None:
        if self.kept(name + ".weight"):
            weight = 1.0 + 0.1 * self.rng.standard_normal(size)
            self.writer.add_tensor(name + ".weight", weight.astype(np.float32))
        if bias and self.kept(name + ".bias"):
            self.writer.add_tensor(name + ".bias", np.zeros(size, dtype=np.float32))

    def encoder_layer(self, prefix: str, width: int, n_ff: int, k_bias: bool = True) -> None:
        """A transformer layer's attention, norms and feed-forward (a ViT's,
        a whisper encoder's: whose ``attn_k`` has no bias)."""
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            self.tensor(f"{prefix}.{part}.weight", (width, width), 0.3)
            if k_bias or part != "attn_k":
                self.tensor(f"{prefix}.{part}.bias", (width,), 0.05)
        self.norm(f"{prefix}.ln1", width)
        self.norm(f"{prefix}.ln2", width)
        self.tensor(f"{prefix}.ffn_up.weight", (n_ff, width), 0.3)
        self.tensor(f"{prefix}.ffn_up.bias", (n_ff,), 0.05)
        self.tensor(f"{prefix}.ffn_down.weight", (width, n_ff), 0.3)
        self.tensor(f"{prefix}.ffn_down.bias", (width,), 0.05)


def clip_writer(path: Path, name: str) -> gguf.GGUFWriter:
    """A projector GGUF's writer (architecture ``clip``, F32), named ``name``."""
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    return writer


def finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    """Write out what ``writer`` holds; ``path``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
    writer = clip_writer(path, "wsserver-tiny-test-mmproj")
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
    return finish(writer, path)


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
    out = TinyTensors(writer, np.random.default_rng(seed), omit, quantize)
    n_patches = (image_size // patch_size) ** 2

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
    out.metadata(scalars)

    out.tensor("v.patch_embd.weight", (width, 3, patch_size, patch_size), 0.2)
    out.tensor("v.patch_embd.bias", (width,), 0.1)
    out.tensor("v.position_embd.weight", (n_patches, width), 0.5)
    for layer in range(n_layer):
        out.encoder_layer(f"v.blk.{layer}", width, n_ff)
    # Large enough that the image's embeddings move the text model's output.
    out.tensor("mm.0.weight", (text_width, width), 0.5)
    out.tensor("mm.0.bias", (text_width,), 0.1)
    out.tensor("mm.2.weight", (text_width, text_width), 0.5)
    out.tensor("mm.2.bias", (text_width,), 0.1)

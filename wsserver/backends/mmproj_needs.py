"""What the projector checks share: the findings, a vision tower's needs.

:mod:`.mmproj_check` reads a projector GGUF's header and dispatches on its
type; each type's graph is written down beside it (LLaVA's ``mlp`` there,
the SigLIP types in :mod:`.mmproj_siglip`). They all gather what is missing
or misshapen in one :class:`Needs`, so that a refusal names every piece at
once, and they share the vision metadata every type reads
(:func:`vision_hparams`), a CLIP/SigLIP layer's tensors (:func:`vit_layer`)
and the ggml types a tensor may have (:func:`tensor_types`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .gguf_meta import GgufHeader

__all__ = [
    "MAX_PATCHES",
    "VISION",
    "Needs",
    "Projector",
    "ProjectorError",
    "tensor_types",
    "vision_hparams",
    "vit_layer",
]

#: Patches per image (one slice) a projector may claim: 64 x 64.
MAX_PATCHES = 4096
#: The vision metadata's prefix.
VISION = "clip.vision."
#: Vision metadata libmtmd reads as required (``get_u32``/``get_f32``).
_REQUIRED_INTS = (
    "embedding_length",
    "attention.head_count",
    "feed_forward_length",
    "block_count",
    "projection_dim",
    "image_size",
    "patch_size",
)

#: ggml types (``ggml.h``'s ids) a tensor may have, by what the graph does
#: with it. A quantized patch-embedding kernel aborts the process in the
#: warm-up encode (``GGML_ASSERT`` in the scheduler: tried here), so the
#: convolution's kernel and the 1-D tensors (biases, norms) must be floats;
#: matrix weights and the position table may be quantized (what quantized
#: projectors do) in the types the CPU backend multiplies.
FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16
_VECTOR_TYPES = frozenset({0, 1})  # F32, F16
_MATRIX_TYPES = FLOAT_TYPES | {2, 3, 6, 7, 8, 10, 11, 12, 13, 14}  # Q4_0 … Q8_0, Q2_K … Q6_K


class ProjectorError(ValueError):
    """The projector is refused; the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class Projector:
    """What a checked projector is and takes."""

    projector_type: str
    #: The modalities it encodes.
    vision: bool
    audio: bool
    #: The square side an image (or one of its slices) is resized to, and
    #: its patches' side.
    image_size: int
    patch_size: int
    #: Its embeddings' width: the text model's embedding width.
    output_width: int
    #: Patches merged into one embedding, per side (Gemma 3's pooling,
    #: Idefics3's pixel shuffle; 1: none).
    merge: int = 1

    @property
    def image_tokens(self) -> int:
        """The embeddings one image slice becomes (an Idefics3 image is an
        overview and up to a grid of slices, each of these); 0 without vision."""
        if not self.patch_size:
            return 0
        return ((self.image_size // self.patch_size) // self.merge) ** 2


class Needs:
    """The checks' findings, gathered so that one refusal names them all."""

    def __init__(self, header: GgufHeader) -> None:
        self.meta = header.metadata
        self.tensors = header.tensors
        self.problems: list[str] = []
        #: Every tensor name a check asked about (present or not).
        self.asked: set[str] = set()

    def positive(self, key: str) -> int:
        value = self.meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"metadata {key}" + ("" if value is None else " (not an integer)"))
            return 0
        if value <= 0:
            self.problems.append(f"metadata {key} = {value} (must be positive)")
            return 0
        return value

    def floats(self, key: str, count: int) -> None:
        value = self.meta.get(key)
        if not isinstance(value, list) or len(value) < count:
            self.problems.append(f"metadata {key} (an array of {count} numbers)")

    def optional(self, name: str, *shapes: tuple[int | None, ...]) -> None:
        """A tensor the graph uses when present: if it is, one of ``shapes``."""
        self.asked.add(name)
        info = self.tensors.get(name)
        if info is not None and not any(_fits(info.shape, shape) for shape in shapes):
            self.tensor(name, shapes[0])  # names it, with the shape it should have

    def tensor(self, name: str, shape: tuple[int | None, ...] | None = None) -> tuple[int, ...]:
        """The tensor's shape; ``None`` in ``shape`` matches any size."""
        self.asked.add(name)
        info = self.tensors.get(name)
        if info is None:
            self.problems.append(f"tensor {name}")
            return ()
        if shape is not None and not _fits(info.shape, shape):
            wanted = "x".join("*" if d is None else str(d) for d in shape)
            got = "x".join(str(d) for d in info.shape)
            self.problems.append(f"tensor {name} is {got}, not {wanted}")
        return info.shape

    def refuse(self) -> None:
        """Raise :class:`ProjectorError` naming every problem, if there are any."""
        if self.problems:
            raise ProjectorError("; ".join(self.problems))


def _fits(got: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    return len(got) == len(want) and all(
        w is None or w == g for g, w in zip(got, want, strict=True)
    )


def vision_hparams(needs: Needs) -> dict[str, int]:
    """The vision metadata every type reads, bounded: its integers by name
    (0 where missing; the problems say so)."""
    ints = {name: needs.positive(VISION + name) for name in _REQUIRED_INTS}
    if not isinstance(needs.meta.get(VISION + "attention.layer_norm_epsilon"), float):
        needs.problems.append(f"metadata {VISION}attention.layer_norm_epsilon")
    needs.floats(VISION + "image_mean", 3)
    needs.floats(VISION + "image_std", 3)
    width, heads = ints["embedding_length"], ints["attention.head_count"]
    size, patch = ints["image_size"], ints["patch_size"]
    if width and heads and width % heads:
        needs.problems.append(f"embedding_length {width} is not a multiple of head_count {heads}")
    # The warm-up encodes an image of image_size: its attention holds
    # patches² scores per head. Far beyond any real projector (LLaVA 1.5:
    # 576 patches, Gemma 3: 4096), a header's claim would take the
    # machine's memory.
    if size and patch and (size // patch) ** 2 > MAX_PATCHES:
        needs.problems.append(
            f"image_size {size} / patch_size {patch}: {(size // patch) ** 2} patches "
            f"(at most {MAX_PATCHES} taken here)"
        )
    for name, most in (
        ("embedding_length", 1 << 14),
        ("block_count", 256),
        ("attention.head_count", 256),
    ):
        if ints[name] > most:
            needs.problems.append(
                f"metadata {VISION}{name} = {ints[name]} (at most {most} taken here)"
            )
    return ints


def vit_layer(needs: Needs, prefix: str, width: int, runs: bool) -> None:
    """A vision layer's tensors: all of them shaped as the graph multiplies
    and adds them (a mismatch is a ``GGML_ASSERT`` abort in the warm-up);
    the attention's projections required in a layer the graph runs."""
    for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
        if runs or part == "attn_out":
            needs.tensor(f"{prefix}.{part}.weight", (width, width))
        else:
            needs.optional(f"{prefix}.{part}.weight", (width, width))
        needs.optional(f"{prefix}.{part}.bias", (width,))
    for norm in ("ln1", "ln2"):
        needs.optional(f"{prefix}.{norm}.weight", (width,))
        needs.optional(f"{prefix}.{norm}.bias", (width,))
    up = needs.tensor(f"{prefix}.ffn_up.weight", (None, None))
    down = needs.tensor(f"{prefix}.ffn_down.weight", (None, None))
    if not up or not down:
        return
    # Old conversions stored up and down swapped; libmtmd swaps them back
    # (weights and biases) when the file's down takes ``width`` values.
    swapped = down[0] == width
    into, out = (down, up) if swapped else (up, down)
    hidden = into[1]
    if into != (width, hidden) or out != (hidden, width):
        needs.problems.append(
            f"tensors {prefix}.ffn_up.weight and {prefix}.ffn_down.weight are {up} and "
            f"{down}, not a {width} -> n -> {width} pair"
        )
    needs.optional(f"{prefix}.{'ffn_down' if swapped else 'ffn_up'}.bias", (hidden,))
    needs.optional(f"{prefix}.{'ffn_up' if swapped else 'ffn_down'}.bias", (width,))
    needs.optional(f"{prefix}.ffn_gate.weight", (width, hidden))
    needs.optional(f"{prefix}.ffn_gate.bias", (hidden,))


def tensor_types(needs: Needs) -> None:
    """Every tensor's ggml type, by what the graph does with it (above)."""
    for name, info in needs.tensors.items():
        if name == "v.patch_embd.weight":
            allowed = FLOAT_TYPES
        elif len(info.shape) == 1:
            allowed = _VECTOR_TYPES
        else:
            allowed = _MATRIX_TYPES
        if info.ggml_type not in allowed:
            needs.problems.append(
                f"tensor {name} has ggml type {info.ggml_type}, not one taken here"
            )

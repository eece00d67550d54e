"""A vision projector's GGUF checked from its header, before libmtmd sees it.

A projector file (``mmproj``) is input like a model file, and libmtmd trusts
it: many of the tensors a projector type's graph uses are *optional* when
libmtmd loads the file, and ``mtmd_init_from_file`` then runs a warm-up
encode through that graph — a missing ``mm.2.weight``,
``v.position_embd.weight`` or ``v.blk.0.attn_q.weight`` is a null pointer
dereferenced inside the native call (SIGSEGV: the whole server is gone, not
one load). So the file's metadata and tensor list are read here, from the
header alone (:func:`.gguf_meta.read_header`, no tensor data), and checked
against what its projector type's graph needs; what is missing or of the
wrong shape is refused with every name at once.

Only the projector types whose needs are written down here are let through:
today LLaVA's ``mlp`` (and its ``mlp_norm`` variant, which libmtmd picks when
``mm.3.weight`` exists), read off llama.cpp's ``tools/mtmd/clip.cpp``
(``load_hparams``, ``load_tensors``) and ``models/llava.cpp`` (the graph).
Any other type is refused by name: libmtmd knows some 60, and a type we have
not read is one whose missing tensor we cannot rule out. A file's audio
encoder (``clip.has_audio_encoder``) is checked by :mod:`.mmproj_audio`,
handed in by the loader (it builds on :class:`_Needs` here); a projector may
have either encoder or both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_meta import GgufHeader, read_header

__all__ = [
    "CHECKED_TYPES",
    "MAX_PATCHES",
    "AudioCheck",
    "Projector",
    "ProjectorError",
    "check_projector",
]

#: The projector types whose graph's needs this module checks.
CHECKED_TYPES = ("mlp",)
#: Patches per image (one slice) a projector may claim: 64 x 64.
MAX_PATCHES = 4096

_V = "clip.vision."
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
_FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16
_VECTOR_TYPES = frozenset({0, 1})  # F32, F16
_MATRIX_TYPES = _FLOAT_TYPES | {2, 3, 6, 7, 8, 10, 11, 12, 13, 14}  # Q4_0 … Q8_0, Q2_K … Q6_K


class ProjectorError(ValueError):
    """The projector is refused; the message names what is wrong."""


@dataclass(frozen=True, slots=True)
class Projector:
    """What a checked projector is and takes."""

    projector_type: str
    #: The modalities it encodes.
    vision: bool
    audio: bool
    #: The square side an image is resized to, and its patches' side.
    image_size: int
    patch_size: int
    #: Its embeddings' width: the text model's embedding width.
    output_width: int

    @property
    def image_tokens(self) -> int:
        """The embeddings one image becomes (one slice: no tiling); 0 without vision."""
        return (self.image_size // self.patch_size) ** 2 if self.patch_size else 0


class _Needs:
    """The checks' findings, gathered so that one refusal names them all."""

    def __init__(self, header: GgufHeader) -> None:
        self.meta = header.metadata
        self.tensors = header.tensors
        self.problems: list[str] = []

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
        info = self.tensors.get(name)
        if info is not None and not any(_fits(info.shape, shape) for shape in shapes):
            self.tensor(name, shapes[0])  # names it, with the shape it should have

    def tensor(self, name: str, shape: tuple[int | None, ...] | None = None) -> tuple[int, ...]:
        """The tensor's shape; ``None`` in ``shape`` matches any size."""
        info = self.tensors.get(name)
        if info is None:
            self.problems.append(f"tensor {name}")
            return ()
        if shape is not None and not _fits(info.shape, shape):
            wanted = "x".join("*" if d is None else str(d) for d in shape)
            got = "x".join(str(d) for d in info.shape)
            self.problems.append(f"tensor {name} is {got}, not {wanted}")
        return info.shape


def _fits(got: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    return len(got) == len(want) and all(
        w is None or w == g for g, w in zip(got, want, strict=True)
    )


def _layer(needs: _Needs, prefix: str, width: int, runs: bool) -> None:
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


def _llava(needs: _Needs, text_width: int | None) -> Projector:
    """LLaVA's ``mlp`` projector: a CLIP ViT, then one or two linear layers."""
    ints = {name: needs.positive(_V + name) for name in _REQUIRED_INTS}
    if not isinstance(needs.meta.get(_V + "attention.layer_norm_epsilon"), float):
        needs.problems.append(f"metadata {_V}attention.layer_norm_epsilon")
    needs.floats(_V + "image_mean", 3)
    needs.floats(_V + "image_std", 3)
    width, heads, layers = (
        ints["embedding_length"],
        ints["attention.head_count"],
        ints["block_count"],
    )
    size, patch = ints["image_size"], ints["patch_size"]
    if width and heads and width % heads:
        needs.problems.append(f"embedding_length {width} is not a multiple of head_count {heads}")
    if size and patch and size % patch:
        needs.problems.append(f"image_size {size} is not a multiple of patch_size {patch}")
    # The warm-up encodes an image of image_size: its attention holds
    # patches² scores per head. Far beyond any real projector (LLaVA 1.5:
    # 576 patches), a header's claim would take the machine's memory.
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
            needs.problems.append(f"metadata {_V}{name} = {ints[name]} (at most {most} taken here)")
    if needs.problems:  # the shapes below are sized from these
        return _refused(needs)

    n_pos = (size // patch) ** 2 + (1 if "v.class_embd" in needs.tensors else 0)
    needs.tensor("v.patch_embd.weight", (patch, patch, 3, width))
    position = needs.tensor("v.position_embd.weight", (width, None))
    if position and position[1] < n_pos:
        needs.problems.append(f"tensor v.position_embd.weight has {position[1]} rows, not {n_pos}")
    # The graph runs the layers below the deepest feature layer (by default
    # the second-to-last: block_count - 1 layers); libmtmd loads every
    # layer's output and feed-forward weights as required.
    features = needs.meta.get(_V + "feature_layer")
    graph_layers = layers - 1
    if isinstance(features, list) and features:
        graph_layers = max(int(f) for f in features)
        if graph_layers > layers:
            needs.problems.append(f"metadata {_V}feature_layer {graph_layers} > {layers}")
            graph_layers = layers
    for layer in range(layers):
        _layer(needs, f"v.blk.{layer}", width, layer < graph_layers)
    for name in ("v.patch_embd.bias", "v.pre_ln.weight", "v.pre_ln.bias"):
        needs.optional(name, (width,))
    for name in ("v.post_ln.weight", "v.post_ln.bias"):
        needs.optional(name, (width,))
    needs.optional("v.class_embd", (width,), (width, 1))

    first = needs.tensor("mm.0.weight", (None, None))
    hidden = first[1] if first else None  # unknown: its shapes are not compared
    if first and not isinstance(features, list) and first[0] != width:
        needs.problems.append(f"tensor mm.0.weight takes {first[0]} values, not {width}")
    needs.tensor("mm.0.bias", (hidden,))
    if "mm.3.weight" in needs.tensors:  # libmtmd's mlp_norm: linear, norm, GELU, linear, norm
        needs.tensor("mm.1.weight", (hidden,))
        needs.tensor("mm.1.bias", (hidden,))
        last = needs.tensor("mm.3.weight", (hidden, None))
        output = last[1] if last else None
        for name in ("mm.3.bias", "mm.4.weight", "mm.4.bias"):
            needs.tensor(name, (output,))
    else:  # linear, GELU, linear (libmtmd reads its output width off mm.2.weight)
        last = needs.tensor("mm.2.weight", (hidden, None))
        output = last[1] if last else None
        needs.tensor("mm.2.bias", (output,))
    if output is not None and text_width is not None and output != text_width:
        needs.problems.append(
            f"its output width {output} is not the text model's embedding width {text_width}"
        )
    for name, info in needs.tensors.items():
        if name == "v.patch_embd.weight":
            allowed = _FLOAT_TYPES
        elif len(info.shape) == 1:
            allowed = _VECTOR_TYPES
        else:
            allowed = _MATRIX_TYPES
        if info.ggml_type not in allowed:
            needs.problems.append(
                f"tensor {name} has ggml type {info.ggml_type}, not one taken here"
            )
    if needs.problems:
        return _refused(needs)
    return Projector(
        projector_type="mlp",
        vision=True,
        audio=False,
        image_size=size,
        patch_size=patch,
        output_width=output or 0,
    )


def _refused(needs: _Needs) -> Projector:
    raise ProjectorError("; ".join(needs.problems))


def _projector_type(meta: dict[str, Any]) -> str:
    for key in ("clip.projector_type", "clip.vision.projector_type"):
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value
    raise ProjectorError("no clip.projector_type in its metadata")


#: Checks a file's audio encoder (:func:`.mmproj_audio.check_audio`, handed
#: in by the loader: it builds on this module): its type and output width.
AudioCheck = Callable[[GgufHeader, "int | None"], tuple[str, int]]


def check_projector(
    path: str | Path, *, text_width: int | None = None, audio: AudioCheck | None = None
) -> Projector:
    """Check the projector at ``path`` (for a text model of ``text_width``).

    Raises :class:`ProjectorError` naming what is wrong: not a projector, a
    type not checked here (by name), or every missing or misshapen piece.
    A file's audio encoder is checked by ``audio`` (without it, refused).
    Blocking (reads the file's header).
    """
    try:
        header = read_header(path)
    except OSError as exc:
        raise ProjectorError(f"cannot read it: {exc}") from None
    except ValueError as exc:
        raise ProjectorError(str(exc)) from None
    meta = header.metadata
    if meta.get("general.architecture") != "clip":
        arch = meta.get("general.architecture")
        raise ProjectorError(f"not a projector (general.architecture is {arch!r}, not 'clip')")
    has_audio = meta.get("clip.has_audio_encoder") is True
    if has_audio and audio is None:
        raise ProjectorError("it has an audio encoder: audio projectors are not checked here")
    heard = audio(header, text_width) if audio is not None and has_audio else None
    if meta.get("clip.has_vision_encoder") is not True:
        if heard is not None:
            return Projector(heard[0], False, True, 0, 0, heard[1])
        raise ProjectorError("metadata clip.has_vision_encoder is not true")
    kind = _projector_type(meta)
    if kind not in CHECKED_TYPES:
        raise ProjectorError(
            f"projector type {kind!r} is not one wsserver checks before loading "
            f"(it checks: {', '.join(CHECKED_TYPES)})"
        )
    projector = _llava(_Needs(header), text_width)
    return dataclasses.replace(projector, audio=has_audio)

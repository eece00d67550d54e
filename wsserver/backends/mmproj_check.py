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

Only the projector types whose needs are written down are let through
(:data:`CHECKED_TYPES`): LLaVA's ``mlp`` here (and its ``mlp_norm`` variant,
which libmtmd picks when ``mm.3.weight`` exists), read off llama.cpp's
``tools/mtmd/clip.cpp`` (``load_hparams``, ``load_tensors``) and
``models/llava.cpp`` (the graph); Gemma 3's ``gemma3`` and SmolVLM's
``idefics3`` in :mod:`.mmproj_siglip`. What the checks share (the findings,
the vision metadata, a ViT layer, the ggml types) is :mod:`.mmproj_needs`.
Any other type is refused by name: libmtmd knows some 60, and a type we have
not read is one whose missing tensor we cannot rule out. The M-RoPE types
(Qwen2-VL and its kin) are refused saying why: the engine writes one
position a token, not their grid of positions. A file's audio encoder
(``clip.has_audio_encoder``) is checked by :mod:`.mmproj_audio`; a projector
may have either encoder or both.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .gguf_meta import read_header
from .mmproj_audio import check_audio
from .mmproj_needs import (
    MAX_PATCHES,
    VISION,
    Needs,
    Projector,
    ProjectorError,
    tensor_types,
    vision_hparams,
    vit_layer,
)
from .mmproj_siglip import SIGLIP_TYPES, check_siglip

__all__ = ["CHECKED_TYPES", "MAX_PATCHES", "Projector", "ProjectorError", "check_projector"]

#: The projector types whose graph's needs this module checks.
CHECKED_TYPES = ("mlp", *SIGLIP_TYPES)
#: Types whose model places an image's embeddings at M-RoPE positions
#: (``mtmd_decode_use_mrope``: a grid of positions, not one a token), which
#: the engine does not write.
_MROPE_TYPES = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "qwen2.5o", "glm4v")
_V = VISION


def _llava(needs: Needs, text_width: int | None) -> Projector:
    """LLaVA's ``mlp`` projector: a CLIP ViT, then one or two linear layers."""
    ints = vision_hparams(needs)
    width, layers = ints["embedding_length"], ints["block_count"]
    size, patch = ints["image_size"], ints["patch_size"]
    if size and patch and size % patch:
        needs.problems.append(f"image_size {size} is not a multiple of patch_size {patch}")
    needs.refuse()  # the shapes below are sized from these

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
        vit_layer(needs, f"v.blk.{layer}", width, layer < graph_layers)
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
    tensor_types(needs)
    needs.refuse()
    return Projector(
        projector_type="mlp",
        vision=True,
        audio=False,
        image_size=size,
        patch_size=patch,
        output_width=output or 0,
    )


def _projector_type(meta: dict[str, Any]) -> str:
    for key in ("clip.projector_type", "clip.vision.projector_type"):
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value
    raise ProjectorError("no clip.projector_type in its metadata")


def check_projector(path: str | Path, *, text_width: int | None = None) -> Projector:
    """Check the projector at ``path`` (for a text model of ``text_width``).

    Raises :class:`ProjectorError` naming what is wrong: not a projector, a
    type not checked here (by name), or every missing or misshapen piece —
    of its vision encoder, its audio encoder (:mod:`.mmproj_audio`), or both.
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
    heard = check_audio(header, text_width) if has_audio else None
    if meta.get("clip.has_vision_encoder") is not True:
        if heard is not None:
            return Projector(heard[0], False, True, 0, 0, heard[1])
        raise ProjectorError("metadata clip.has_vision_encoder is not true")
    kind = _projector_type(meta)
    if kind not in CHECKED_TYPES:
        mrope = "; its model places images at M-RoPE positions, which the engine does not write"
        raise ProjectorError(
            f"projector type {kind!r} is not one wsserver checks before loading "
            f"(it checks: {', '.join(CHECKED_TYPES)})" + (mrope if kind in _MROPE_TYPES else "")
        )
    if kind in SIGLIP_TYPES:
        projector = check_siglip(Needs(header), kind, text_width)
    else:
        projector = _llava(Needs(header), text_width)
    return dataclasses.replace(projector, audio=has_audio)

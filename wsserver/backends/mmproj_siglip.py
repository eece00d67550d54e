"""The SigLIP projectors' needs: Gemma 3's ``gemma3`` and SmolVLM's ``idefics3``.

Read off llama.cpp's ``tools/mtmd/clip.cpp`` (``load_hparams``,
``load_tensors``, ``clip_n_output_tokens``), ``models/siglip.cpp`` and
``build_vit`` (the graph), and ``mtmd.cpp``/``mtmd-image.cpp`` (how an image
becomes chunks). Both types run a SigLIP tower — the patch convolution,
learned positions, **every** layer (not the second-to-last, as LLaVA's
graph does), an optional post-norm — and then:

- ``gemma3``: an average pool of ``scale_factor`` x ``scale_factor``
  patches (4 when the file does not say: 64 x 64 patches → 256 image
  tokens for Gemma 3's 896-pixel images), an RMS norm by
  ``mm.soft_emb_norm.weight`` and ``mm.input_projection.weight``
  (multiplied transposed: ``ne = [text width, vision width]``). An image is
  one 896 x 896 slice; its tokens attend to each other both ways in the
  text model (``mtmd_decode_use_non_causal``: :mod:`.llama_vision`).
- ``idefics3``: a pixel shuffle of ``scale_factor`` x ``scale_factor``
  patches into one (it asserts a factor above 1: a file without it would
  abort the process in the warm-up), then ``mm.model.fc.weight``. An image
  is resized to ``preproc_image_size`` on its longest edge and cut into
  ``image_size`` tiles — an overview and a grid of slices, each its own
  chunk, with the vocabulary's ``<fake_token_around_image>``,
  ``<row_i_col_j>`` and ``<global-img>`` text between them. Without
  ``preproc_image_size`` libmtmd slices at the image's own size, unbounded
  and in ragged tiles: refused.

Where the graph reads a tensor only when it is there, its presence changes
the graph (a fused ``attn_qkv``, per-head norms, layer scales, a MoE
feed-forward …): beyond the tensors written down here a file has nothing —
anything else is refused by name rather than run through a path not read.
"""

from __future__ import annotations

from .mmproj_needs import VISION, Needs, Projector, tensor_types, vision_hparams, vit_layer

__all__ = ["SIGLIP_TYPES", "check_siglip"]

#: The SigLIP projector types checked here.
SIGLIP_TYPES = ("gemma3", "idefics3")
_SCALE = VISION + "projector.scale_factor"
_LONGEST = VISION + "preproc_image_size"
#: An Idefics3 image's grid of slices, per side, at most (SmolVLM: 4 x 4).
MAX_GRID = 8


def _merge(needs: Needs, kind: str, side: int) -> int:
    """The patches merged into one embedding per side, checked."""
    value = needs.meta.get(_SCALE)
    if value is None and kind == "gemma3":
        value = 4  # libmtmd's default for every Gemma 3 size
    if isinstance(value, bool) or not isinstance(value, int):
        needs.problems.append(f"metadata {_SCALE}" + ("" if value is None else " (not an integer)"))
        return 0
    least = 2 if kind == "idefics3" else 1  # idefics3's pixel shuffle asserts a factor > 1
    if value < least:
        needs.problems.append(f"metadata {_SCALE} = {value} (at least {least})")
        return 0
    if side and side % value:
        # Gemma 3's pool would drop patches and Idefics3's shuffle pad
        # them: either way not the token count libmtmd sizes its output by.
        needs.problems.append(f"{side} patches a side are not a multiple of {_SCALE} {value}")
    return value


def _heads(needs: Needs, width: int, heads: int) -> None:
    """Optional attention metadata that changes how the graph splits heads."""
    kv = needs.meta.get(VISION + "attention.head_count_kv")
    if kv is not None and kv != heads:
        needs.problems.append(f"metadata {VISION}attention.head_count_kv = {kv}, not {heads}")
    head_dim = needs.meta.get(VISION + "attention.head_dim")
    if head_dim is not None and heads and head_dim != width // heads:
        needs.problems.append(
            f"metadata {VISION}attention.head_dim = {head_dim}, not {width // heads}"
        )


def _longest_edge(needs: Needs, size: int) -> None:
    value = needs.meta.get(_LONGEST)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        needs.problems.append(
            f"metadata {_LONGEST} (the longest edge Idefics3 slices an image at)"
            + ("" if value is None else f" = {value!r}")
        )
    elif size and -(-value // size) > MAX_GRID:
        needs.problems.append(
            f"metadata {_LONGEST} = {value}: a grid of {-(-value // size)} slices a side "
            f"(at most {MAX_GRID} taken here)"
        )


def check_siglip(needs: Needs, kind: str, text_width: int | None) -> Projector:
    """A ``gemma3`` or ``idefics3`` projector (see the module docstring);
    :class:`.ProjectorError` names every missing or misshapen piece."""
    ints = vision_hparams(needs)
    width, heads, layers = (
        ints["embedding_length"],
        ints["attention.head_count"],
        ints["block_count"],
    )
    size, patch = ints["image_size"], ints["patch_size"]
    side = size // patch if size and patch else 0  # the convolution's floor
    if size and patch and not side:
        needs.problems.append(f"image_size {size} is smaller than patch_size {patch}")
    merge = _merge(needs, kind, side)
    _heads(needs, width, heads)
    if kind == "idefics3":
        _longest_edge(needs, size)
    needs.refuse()  # the shapes below are sized from these

    needs.tensor("v.patch_embd.weight", (patch, patch, 3, width))
    needs.optional("v.patch_embd.bias", (width,))
    # Added to the patches as they are: one row each, no class embedding.
    needs.tensor("v.position_embd.weight", (width, side * side))
    for name in ("v.pre_ln", "v.post_ln"):
        needs.optional(name + ".weight", (width,))
        needs.optional(name + ".bias", (width,))
    for layer in range(layers):  # build_vit runs every layer
        vit_layer(needs, f"v.blk.{layer}", width, True)
    if kind == "gemma3":
        needs.tensor("mm.soft_emb_norm.weight", (width,))
        projection = needs.tensor("mm.input_projection.weight", (None, width))
        output = projection[0] if projection else None
    else:
        fc = needs.tensor("mm.model.fc.weight", (width * merge * merge, None))
        output = fc[1] if fc else None
    if output is not None and text_width is not None and output != text_width:
        needs.problems.append(
            f"its output width {output} is not the text model's embedding width {text_width}"
        )
    for name in sorted(set(needs.tensors) - needs.asked):
        needs.problems.append(f"tensor {name} (not one a {kind} projector has here)")
    tensor_types(needs)
    needs.refuse()
    return Projector(
        projector_type=kind,
        vision=True,
        audio=False,
        image_size=size,
        patch_size=patch,
        output_width=output or 0,
        merge=merge,
    )

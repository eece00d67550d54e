"""A model's vision projector, through llama.cpp's libmtmd (``llama_cpp.mtmd_cpp``).

Loading: the projector GGUF is checked from its header first
(:mod:`.mmproj_check`: libmtmd dereferences missing tensors inside
``mtmd_init_from_file``'s warm-up encode, which kills the process), then
libmtmd loads it against the text model (it refuses a projector whose output
width is not the model's). A refusal from either is the model's
``model_load_failed``, naming the projector and what is wrong.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd

from ..errors import ModelLoadError
from .llama_context import log_bridge
from .mmproj_check import Projector, ProjectorError, check_projector

__all__ = ["Vision", "load_vision"]

log = logging.getLogger("wsserver.llama.vision")


class Vision:
    """A loaded projector: libmtmd's context for one text model."""

    def __init__(self, ctx: Any, projector: Projector, path: Path) -> None:
        self.ctx = ctx
        self.projector = projector
        self.path = path

    @property
    def modalities(self) -> tuple[str, ...]:
        """What the model takes in: text, and what the projector encodes."""
        kinds = ["text"]
        if mtmd.mtmd_support_vision(self.ctx):
            kinds.append("image")
        if mtmd.mtmd_support_audio(self.ctx):
            kinds.append("audio")
        return tuple(kinds)

    def close(self) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx:
            mtmd.mtmd_free(ctx)


def load_vision(path: str | Path, model: Any, n_threads: int) -> Vision:
    """Check the projector at ``path`` and load it for ``model`` (a
    ``llama_model`` pointer), on the CPU. Blocking; :class:`ModelLoadError`
    on refusal."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"projector file not found: {path}")
    text_width = llama_cpp.llama_model_n_embd(model)
    try:
        projector = check_projector(path, text_width=text_width)
    except ProjectorError as exc:
        raise ModelLoadError(f"projector {path} refused: {exc}") from None
    mtmd.mtmd_log_set(log_bridge(), ctypes.c_void_p(0))
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False  # the text model's n_gpu_layers says nothing of the projector
    params.n_threads = n_threads
    params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
    if not ctx:
        raise ModelLoadError(f"projector {path}: libmtmd could not load it (see the log)")
    log.info(
        "projector %s (%s): %d-pixel images, %d tokens each",
        path,
        projector.projector_type,
        projector.image_size,
        projector.image_tokens,
    )
    return Vision(ctx, projector, path)

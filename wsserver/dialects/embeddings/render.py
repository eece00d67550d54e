"""Embeddings and rerank answers, rendered (sans-I/O).

``/v1/embeddings``: OpenAI's list of ``embedding`` objects, each vector a
list of floats or (``base64``) its little-endian float32 bytes in base64,
and ``usage`` (``prompt_tokens`` = ``total_tokens``: the tokens the engine
read). ``/v1/rerank``: ``results`` sorted by ``relevance_score``, best first
(ties by index), cut to ``top_n``, each with its ``document`` (``{"text"}``)
if asked for — the shape llama-server, vLLM and Jina share.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from ...core.embedding import Embedded, floats_of
from .api import Encoding, RerankRequest

__all__ = ["embeddings_body", "rerank_body"]


def _usage(result: Embedded) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}


def embeddings_body(result: Embedded, *, model: str, encoding: Encoding) -> bytes:
    """The whole ``/v1/embeddings`` answer."""
    data: list[dict[str, Any]] = []
    for index, vector in enumerate(result.vectors):
        embedding: Any = (
            base64.b64encode(vector).decode("ascii") if encoding == "base64" else floats_of(vector)
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return orjson.dumps({"object": "list", "data": data, "model": model, "usage": _usage(result)})


def rerank_body(result: Embedded, request: RerankRequest, *, model: str) -> bytes:
    """The whole ``/v1/rerank`` answer."""
    order = sorted(range(len(result.scores)), key=lambda i: (-result.scores[i], i))
    results: list[dict[str, Any]] = []
    for index in order[: request.top_n]:
        entry: dict[str, Any] = {"index": index, "relevance_score": result.scores[index]}
        if request.return_documents:
            entry["document"] = {"text": request.documents[index]}
        results.append(entry)
    return orjson.dumps(
        {"object": "list", "model": model, "results": results, "usage": _usage(result)}
    )

"""``POST /v1/embeddings`` and ``POST /v1/rerank`` bodies, parsed (sans-I/O).

**Embeddings** (OpenAI's shape): ``input`` is a string, an array of strings,
an array of token ids, or an array of token-id arrays; ``encoding_format``
``float`` (the default) or ``base64`` (little-endian float32, what the
``openai`` SDK asks for by default); ``model`` and ``user`` as OpenAI's.
``dimensions`` is refused by name: no model here is trained to be cut short
(Matryoshka), and a vector cut anyway would not be what was asked for.

**Rerank** (the shape llama-server, vLLM, Jina and Cohere share): ``query``
(a string), ``documents`` (strings), ``top_n`` (the best this many; default
all), ``return_documents`` (each result carries its document's text).

Every field is honoured, harmless (``user``), refused by name (extensions
that would change the answer: truncation, normalisation) or unknown — and
then refused too. Bounds, before anything is queued: at most
:data:`~wsserver.core.embedding.MAX_EMBED_INPUTS` inputs, no empty input (an
empty string, an empty token array), token ids that are integers ≥ 0 (the
engine checks them against its vocabulary).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, Literal

from ...core.embedding import (
    DEFAULT_LIMITS,
    Embed,
    EmbedInput,
    EmbedInputError,
    EmbedLimits,
    parse_inputs,
)
from ..api_errors import ApiError, Fields, parse_json

__all__ = [
    "EMBEDDING_FIELDS",
    "RERANK_FIELDS",
    "EmbeddingsRequest",
    "Encoding",
    "RerankRequest",
    "parse_embeddings",
    "parse_rerank",
]

Encoding = Literal["float", "base64"]

_TRUNCATE: Final = (
    "inputs are never truncated here: an input longer than the model embeds is refused "
    "with its index; shorten it"
)
_NORMALIZE: Final = "vectors are returned as the model gives them (docs/embeddings.md)"

EMBEDDING_FIELDS: Final = Fields(
    honoured=frozenset({"input", "model", "encoding_format"}),
    harmless={"user": lambda value: value is None or isinstance(value, str)},
    refused={
        "dimensions": (
            "no model here is trained to give shorter vectors: leave it out "
            "(the vectors are the model's own size)"
        ),
        "truncate_prompt_tokens": _TRUNCATE,
        "truncate": _TRUNCATE,
        "embd_normalize": _NORMALIZE,
        "normalize": _NORMALIZE,
    },
)

RERANK_FIELDS: Final = Fields(
    honoured=frozenset({"query", "documents", "top_n", "return_documents", "model"}),
    harmless={"user": lambda value: value is None or isinstance(value, str)},
    refused={
        "max_chunks_per_doc": "documents are never chunked here",
        "rank_fields": "documents are strings here",
        "truncate_prompt_tokens": _TRUNCATE,
        "truncate": _TRUNCATE,
    },
)


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """A validated ``/v1/embeddings`` body."""

    embed: Embed
    encoding: Encoding
    model: str | None


@dataclass(frozen=True, slots=True)
class RerankRequest:
    """A validated ``/v1/rerank`` body."""

    embed: Embed
    documents: tuple[str, ...]
    top_n: int
    return_documents: bool
    model: str | None


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, "bad_request", param)


def _fields(fields: Fields, given: Mapping[str, Any]) -> None:
    for name, value in given.items():
        reason = fields.refusal(name, value)
        if reason:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"'{name}' is not supported: {reason}",
                "unsupported_option",
                name,
            )
        if reason is not None:
            raise _bad(f"'{name}' is not a field of this API", name)


def _model(given: Mapping[str, Any]) -> str | None:
    model = given.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    return model


def _inputs(value: Any, limits: EmbedLimits) -> tuple[EmbedInput, ...]:
    try:
        return parse_inputs(value, limits)
    except EmbedInputError as exc:
        raise _bad(str(exc), "input") from None


def parse_embeddings(
    body: bytes, request_id: str, limits: EmbedLimits = DEFAULT_LIMITS
) -> EmbeddingsRequest:
    """Validate an embeddings body; raise :class:`ApiError` in OpenAI's shape."""
    given = {k: v for k, v in parse_json(body).items() if v is not None}
    _fields(EMBEDDING_FIELDS, given)
    if "input" not in given:
        raise _bad("'input' is required", "input")
    encoding = given.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise _bad('\'encoding_format\' must be "float" or "base64"', "encoding_format")
    embed = Embed(id=request_id, inputs=_inputs(given["input"], limits), limits=limits)
    return EmbeddingsRequest(embed, encoding, _model(given))


def parse_rerank(
    body: bytes, request_id: str, limits: EmbedLimits = DEFAULT_LIMITS
) -> RerankRequest:
    """Validate a rerank body; raise :class:`ApiError` in OpenAI's error shape."""
    given = {k: v for k, v in parse_json(body).items() if v is not None}
    _fields(RERANK_FIELDS, given)
    query = given.get("query")
    if not isinstance(query, str) or not query:
        raise _bad("'query' must be a non-empty string", "query")
    documents = given.get("documents")
    if not isinstance(documents, list) or not documents:
        raise _bad("'documents' must be a non-empty array of strings", "documents")
    if len(documents) > limits.max_inputs:
        raise _bad(
            f"'documents' has {len(documents)} items; at most {limits.max_inputs} per request",
            "documents",
        )
    for index, document in enumerate(documents):
        if not isinstance(document, str) or not document:
            raise _bad(f"document {index} must be a non-empty string", "documents")
    top_n = given.get("top_n", len(documents))
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise _bad("'top_n' must be an integer >= 1", "top_n")
    return_documents = given.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise _bad("'return_documents' must be a boolean", "return_documents")
    embed = Embed(id=request_id, inputs=tuple(documents), kind="rerank", query=query, limits=limits)
    return RerankRequest(
        embed, tuple(documents), min(top_n, len(documents)), return_documents, _model(given)
    )

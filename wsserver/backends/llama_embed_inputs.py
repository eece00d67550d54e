"""An embedding request's inputs as the llama engine decodes them: tokenized,
checked and bounded (on a worker thread), and the pooling a GGUF embeds with.

Texts are tokenized as llama-cpp-python's ``Llama.embed`` does; a rerank's
document becomes the (query, document) pair llama-server makes. Every bound
holds here, before the engine does any work (docs/embeddings.md, "Limits").
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Final

import llama_cpp

from ..core.embedding import Embed
from ..errors import CONTEXT_LENGTH_EXCEEDED, ProtocolError

__all__ = ["POOLING_NAMES", "gguf_causal", "gguf_pooling", "prepare_inputs", "rerank_tokens"]

#: The names of llama.cpp's pooling types (docs, logs).
POOLING_NAMES: Final = {
    llama_cpp.LLAMA_POOLING_TYPE_NONE: "none",
    llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
    llama_cpp.LLAMA_POOLING_TYPE_LAST: "last",
    llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank",
}


def _meta(model: Any, key: str) -> str | None:
    buffer = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer))
    return buffer.value.decode("utf-8", "replace") if n >= 0 else None


def gguf_pooling(model: Any) -> int:
    """The pooling this model embeds with: the GGUF's ``{arch}.pooling_type``,
    or mean for a model that declares none (a generative model)."""
    arch = _meta(model, "general.architecture") or ""
    declared = _meta(model, f"{arch}.pooling_type")
    try:
        pooling = int(declared) if declared is not None else llama_cpp.LLAMA_POOLING_TYPE_NONE
    except ValueError:
        pooling = llama_cpp.LLAMA_POOLING_TYPE_NONE
    if pooling not in POOLING_NAMES or pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        return llama_cpp.LLAMA_POOLING_TYPE_MEAN
    return pooling


def gguf_causal(model: Any) -> bool:
    """Whether the model's attention is causal (``{arch}.attention.causal``,
    true unless the GGUF says otherwise: an encoder's is not)."""
    arch = _meta(model, "general.architecture") or ""
    return (_meta(model, f"{arch}.attention.causal") or "true").strip().lower() != "false"


def prepare_inputs(
    request: Embed, *, model: Any, pooling: int, n_embd: int, batch_tokens: int, name: str
) -> Embed:
    """``request`` with every input as the tokens the engine decodes, checked
    (off the loop and off the engine thread: a worker thread). Texts are
    tokenized as ``Llama.embed`` does (the model's BOS, special tokens not
    parsed); token ids are taken as given; a rerank's document becomes the
    pair llama-server makes (:func:`rerank_tokens`). Raises
    :class:`~wsserver.errors.ProtocolError`: the model serves the other kind
    (``unsupported_option``), a token outside the vocabulary (``bad_request``),
    an input longer than ``embed_batch`` (``too_large``, detail
    ``context_length_exceeded``), more
    tokens or vector bytes than the request's limits (``bad_request``)."""
    kind = "rerank" if pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK else "embed"
    if request.kind != kind:
        pooled = POOLING_NAMES.get(pooling, str(pooling))
        if request.kind == "rerank":
            message = (
                f"the model {name!r} cannot rerank: its pooling is {pooled}, a reranker's "
                "is rank (serve a reranker GGUF for /v1/rerank)"
            )
        else:
            message = (
                f"the model {name!r} is a reranker (pooling rank): it serves /v1/rerank, "
                "not embeddings"
            )
        raise ProtocolError("unsupported_option", message, request.id)
    if request.tokenized:
        return request
    limits = request.limits
    if kind == "embed" and len(request.inputs) * n_embd * 4 > limits.max_vector_bytes:
        raise ProtocolError(
            "bad_request",
            f"{len(request.inputs)} inputs of {n_embd} dimensions are more than "
            f"{limits.max_vector_bytes} bytes of vectors: send fewer inputs per request",
            request.id,
        )
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model.model))
    query: list[int] = []
    if request.kind == "rerank":
        query = _text_tokens(model, request.query or "")
    out: list[tuple[int, ...]] = []
    total = 0
    for index, given in enumerate(request.inputs):
        if isinstance(given, str):
            tokens = (
                rerank_tokens(model, query, _text_tokens(model, given))
                if request.kind == "rerank"
                else list(model.tokenize(given.encode("utf-8"), add_bos=True, special=False))
            )
        else:
            for token in given:
                if not 0 <= token < n_vocab:
                    raise ProtocolError(
                        "bad_request",
                        f"input {index}: token {token} is not in the model's vocabulary "
                        f"(ids 0 to {n_vocab - 1})",
                        request.id,
                    )
            tokens = list(given)
        if not tokens:
            raise ProtocolError("bad_request", f"input {index} has no tokens", request.id)
        if len(tokens) > batch_tokens and request.truncate:
            tokens = tokens[:batch_tokens]  # its first tokens, as Ollama cuts
        elif len(tokens) > batch_tokens:
            raise ProtocolError(
                "too_large",
                f"input {index} is {len(tokens)} tokens; this model embeds inputs of at most "
                f"{batch_tokens} tokens (backend.llama.embed_batch)",
                request.id,
                detail=CONTEXT_LENGTH_EXCEEDED,
            )
        total += len(tokens)
        if total > limits.max_tokens:
            raise ProtocolError(
                "bad_request",
                f"the inputs are more than {limits.max_tokens} tokens together: "
                "send fewer per request",
                request.id,
            )
        out.append(tuple(tokens))
    return dataclasses.replace(request, inputs=tuple(out), tokenized=True)


def _text_tokens(model: Any, text: str) -> list[int]:
    return list(model.tokenize(text.encode("utf-8"), add_bos=False, special=False))


def rerank_tokens(model: Any, query: list[int], document: list[int]) -> list[int]:
    """A (query, document) pair as llama-server's ``/v1/rerank`` feeds a
    reranker without a rerank template: ``[BOS] query [EOS] [SEP] document
    [EOS]``, each special token where the vocabulary adds it (EOS: SEP when
    the vocabulary has no EOS)."""
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    eos = llama_cpp.llama_vocab_eos(vocab)
    sep = llama_cpp.llama_vocab_sep(vocab)
    if eos == -1:
        eos = sep
    tokens: list[int] = []
    if llama_cpp.llama_vocab_get_add_bos(vocab):
        tokens.append(llama_cpp.llama_vocab_bos(vocab))
    tokens.extend(query)
    if llama_cpp.llama_vocab_get_add_eos(vocab):
        tokens.append(eos)
    if llama_cpp.llama_vocab_get_add_sep(vocab):
        tokens.append(sep)
    tokens.extend(document)
    if llama_cpp.llama_vocab_get_add_eos(vocab):
        tokens.append(eos)
    return tokens

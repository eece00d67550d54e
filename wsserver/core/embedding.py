"""Embedding and rerank work, as the core sees it (sans-I/O).

An embedding request is not a generation: nothing streams, there is no
session row and no ``delta``; the engine turns every input into one vector
(or, for a reranker, one score) and the request ends with all of them at
once. What is shared with generation is the *way in*: the same model
registry, the same scheduler slot, the same engine step and its time budget
(docs/embeddings.md, "Scheduling").

* :class:`Embed` — the request, parsed and bounded by a dialect
  (:mod:`wsserver.dialects.embeddings`): its inputs (text, or token ids
  already tokenized) and what it is for (``embed``, or ``rerank`` with a
  query).
* :class:`Embedded` — the result: each input's vector as little-endian
  float32 bytes (what base64 carries as is, what a float list is made from),
  or each document's score, and the tokens the engine read.
* :class:`EmbedLimits` — the bounds every dialect applies before anything is
  queued: how many inputs, how many tokens in all, how many bytes of vectors.

Vectors are bytes, not lists of floats: a 2,048-input answer of 1,024
dimensions is 8 MiB as float32, and ~45 MiB as a list of Python floats.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_EMBED_INPUTS",
    "MAX_EMBED_TOKENS",
    "MAX_VECTOR_BYTES",
    "Embed",
    "EmbedInput",
    "EmbedInputError",
    "EmbedKind",
    "EmbedLimits",
    "Embedded",
    "floats_of",
    "parse_inputs",
]

#: One input: a text, or token ids the client tokenized itself.
EmbedInput = str | tuple[int, ...]
#: ``embed``: a vector per input; ``rerank``: a score per input (a document),
#: against :attr:`Embed.query`.
EmbedKind = Literal["embed", "rerank"]

#: OpenAI's own bound on ``input``'s items.
MAX_EMBED_INPUTS: Final = 2048
#: Tokens of every input of one request together, at most (OpenAI's is 300,000).
MAX_EMBED_TOKENS: Final = 300_000
#: The vectors of one answer, as float32, at most (64 MiB: 2,048 inputs of 8,192 dimensions).
MAX_VECTOR_BYTES: Final = 64 << 20


@dataclass(frozen=True, slots=True)
class EmbedLimits:
    """What one embedding request may ask of the engine (see the module docstring)."""

    max_inputs: int = MAX_EMBED_INPUTS
    max_tokens: int = MAX_EMBED_TOKENS
    max_vector_bytes: int = MAX_VECTOR_BYTES


#: The limits every dialect applies unless configured otherwise.
DEFAULT_LIMITS: Final = EmbedLimits()


@dataclass(frozen=True, slots=True)
class Embed:
    """One embedding (or rerank) request, validated by its dialect."""

    id: str
    inputs: tuple[EmbedInput, ...]
    kind: EmbedKind = "embed"
    #: ``rerank``: what each input (a document) is scored against.
    query: str | None = None
    #: The model asked for, as the registry resolved it (its served name).
    model: str | None = None
    #: The connection it came on (log lines, the scheduler's owner).
    conn_id: str = ""
    limits: EmbedLimits = DEFAULT_LIMITS
    #: An input longer than the model embeds is cut to its first tokens
    #: (Ollama's ``truncate``); else it is refused with its index.
    truncate: bool = False
    #: How long the model stays loaded after this request (seconds; None:
    #: the model's own keep-alive), as a generation's ``keep_alive``.
    keep_alive: float | None = None
    #: Every input is the engine's tokens already (the model's embedding
    #: door's ``prepare`` made them, checked): nothing more to tokenize.
    tokenized: bool = False


@dataclass(frozen=True, slots=True)
class Embedded:
    """What the engine made of an :class:`Embed`, in input order."""

    #: ``embed``: each input's vector, little-endian float32 (as the model
    #: returned it: not normalised).
    vectors: tuple[bytes, ...] = ()
    #: ``rerank``: each input's relevance score (the model's rank head).
    scores: tuple[float, ...] = ()
    #: Tokens the engine read, every input's together (a rerank's pairs).
    prompt_tokens: int = 0
    #: The vectors' dimensions (0 for a rerank).
    dimensions: int = 0
    #: Milliseconds from the request's start until the engine was its (a
    #: model's load, a wait for a free slot), and until its end.
    queued_ms: float = 0.0
    total_ms: float = 0.0


class EmbedInputError(ValueError):
    """An embedding request's ``input`` that is not one (each wire refuses it its way)."""


def _token_ids(value: list[object], where: str) -> tuple[int, ...]:
    if not value:
        raise EmbedInputError(f"{where} is an empty token array")
    out: list[int] = []
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise EmbedInputError(f"{where}: token ids must be integers >= 0")
        out.append(token)
    return tuple(out)


def parse_inputs(value: object, limits: EmbedLimits = DEFAULT_LIMITS) -> tuple[EmbedInput, ...]:
    """OpenAI's ``input`` in any of its four shapes — a string, strings, token
    ids, token-id arrays —, each item checked, in order: no empty item, token
    ids integers >= 0 (the engine checks its vocabulary), at most
    ``limits.max_inputs`` items. Raises :class:`EmbedInputError`."""
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list):
        if not value:
            raise EmbedInputError("'input' is an empty array: give at least one input")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (_token_ids(value, "'input'"),)
        items = value
    else:
        raise EmbedInputError(
            "'input' must be a string, an array of strings, an array of token ids "
            "or an array of token-id arrays"
        )
    if len(items) > limits.max_inputs:
        raise EmbedInputError(
            f"'input' has {len(items)} items; at most {limits.max_inputs} per request"
        )
    out: list[EmbedInput] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise EmbedInputError(f"input {index} is an empty string")
            out.append(item)
        elif isinstance(item, list):
            out.append(_token_ids(item, f"input {index}"))
        else:
            raise EmbedInputError(f"input {index} is neither a string nor an array of token ids")
    return tuple(out)


def floats_of(vector: bytes) -> list[float]:
    """A vector's float32 bytes as a list of floats (the ``float`` encoding)."""
    values = array.array("f")
    values.frombytes(vector)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is
        values.byteswap()
    return values.tolist()

"""The fake engine's embeddings and rerank scores: deterministic, for wire tests.

A text's vector depends only on the text (a token array's on its ids): 16
float32 components drawn from the SHA-256 of the input, so the same input
always gives the same vector, and tests can compute it
(:func:`fake_vector`). A rerank score is the dot product of the query's and
the document's vectors. Tokens are counted as the fake counts a prompt (four
bytes a token); a token id is one of the fake's words (:func:`~.fake.fake_vocabulary`).
Time is simulated as a prompt's (``prefill_ms_per_token`` for each input's
tokens), waited on the request's cancel event: a cancel ends it at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
import threading
from typing import Final, Protocol

from ..core.embedding import Embed, Embedded, EmbedInput
from ..errors import CONTEXT_LENGTH_EXCEEDED, ProtocolError, WireCode
from .base import CancelEvent
from .embed_door import EmbedDoor, EmbedSubmission


class _FakeSettings(Protocol):
    """What the door reads of the fake engine, live (tests change them)."""

    prefill_ms_per_token: float
    model_name: str


__all__ = [
    "FAKE_DIMENSIONS",
    "FAKE_EMBED_TOKENS",
    "FakeEmbedDoor",
    "check_fake_inputs",
    "fake_score",
    "fake_tokens_of",
    "fake_vector",
    "run_fake_embed",
]

#: The fake's vectors' dimensions.
FAKE_DIMENSIONS: Final = 16
#: The longest input the fake embeds, in its tokens (the llama engine's ``embed_batch``).
FAKE_EMBED_TOKENS: Final = 512


def fake_tokens_of(item: EmbedInput) -> int:
    """An input's tokens, as the fake counts them."""
    if isinstance(item, str):
        return max(1, len(item.encode()) // 4)
    return len(item)


def fake_vector(item: EmbedInput) -> bytes:
    """An input's vector: little-endian float32, components in [-1, 1)."""
    key = item.encode() if isinstance(item, str) else b"\x00" + struct.pack(f"<{len(item)}q", *item)
    digest = hashlib.sha256(key).digest()
    values = [(digest[i] * 256 + digest[i + 1]) / 32768.0 - 1.0 for i in range(0, 32, 2)]
    return struct.pack(f"<{FAKE_DIMENSIONS}f", *values)


def fake_score(query: str, document: EmbedInput) -> float:
    """A document's relevance to the query: their vectors' dot product."""
    q = struct.unpack(f"<{FAKE_DIMENSIONS}f", fake_vector(query))
    d = struct.unpack(f"<{FAKE_DIMENSIONS}f", fake_vector(document))
    return math.fsum(a * b for a, b in zip(q, d, strict=True))


def check_fake_inputs(request: Embed, n_vocab: int) -> Embed:
    """``request`` as the fake embeds it: refused as the llama engine refuses
    (a token outside the vocabulary, an input over the longest, more tokens
    than the limits allow), an input over the longest cut to it if the
    request asks (``truncate``: a text to its first bytes, four a token)."""
    total = 0
    inputs = list(request.inputs)
    for index, item in enumerate(inputs):
        if not isinstance(item, str):
            for token in item:
                if not 0 <= token < n_vocab:
                    raise ProtocolError(
                        "bad_request",
                        f"input {index}: token {token} is not in the model's vocabulary "
                        f"(ids 0 to {n_vocab - 1})",
                        request.id,
                    )
        n = fake_tokens_of(item)
        if n > FAKE_EMBED_TOKENS and request.truncate:
            item = inputs[index] = (
                item.encode()[: FAKE_EMBED_TOKENS * 4].decode("utf-8", "ignore")
                if isinstance(item, str)
                else item[:FAKE_EMBED_TOKENS]
            )
            n = fake_tokens_of(item)
        elif n > FAKE_EMBED_TOKENS:
            raise ProtocolError(
                "too_large",
                f"input {index} is {n} tokens; this model embeds inputs of at most "
                f"{FAKE_EMBED_TOKENS} tokens",
                request.id,
                detail=CONTEXT_LENGTH_EXCEEDED,
            )
        total += n
        if total > request.limits.max_tokens:
            raise ProtocolError(
                "bad_request",
                f"the inputs are more than {request.limits.max_tokens} tokens together: "
                "send fewer per request",
                request.id,
            )
    return dataclasses.replace(request, inputs=tuple(inputs))


class FakeEmbedDoor(EmbedDoor):
    """The fake's embedding door: it embeds, and reranks too."""

    def __init__(self, backend: _FakeSettings, *, n_vocab: int) -> None:
        self._backend = backend
        self._n_vocab = n_vocab

    @property
    def kind(self) -> str:
        return "embed"

    def prepare(self, request: Embed) -> Embed:
        return check_fake_inputs(request, self._n_vocab)

    def start(self, request: Embed, *, cancel: CancelEvent) -> EmbedSubmission:
        backend = self._backend
        return run_fake_embed(
            request, cancel, ms_per_token=backend.prefill_ms_per_token, name=backend.model_name
        )


def run_fake_embed(
    request: Embed, cancel: CancelEvent, *, ms_per_token: float, name: str
) -> EmbedSubmission:
    """The fake's :meth:`FakeEmbedDoor.start`: a thread that
    waits its simulated time on ``cancel`` and completes the submission."""
    submission = EmbedSubmission()

    def produce() -> None:
        vectors: list[bytes] = []
        scores: list[float] = []
        tokens = 0
        try:
            for item in request.inputs:
                n = fake_tokens_of(item)
                if ms_per_token > 0 and cancel.wait(ms_per_token * n / 1000.0):
                    return  # cancelled: completed without a result
                if cancel.is_set():
                    return
                tokens += n
                if request.kind == "rerank":
                    scores.append(fake_score(request.query or "", item))
                else:
                    vectors.append(fake_vector(item))
            submission.finish(
                Embedded(
                    vectors=tuple(vectors),
                    scores=tuple(scores),
                    prompt_tokens=tokens,
                    dimensions=0 if request.kind == "rerank" else FAKE_DIMENSIONS,
                )
            )
        except Exception:  # pragma: no cover - a bug in the fake
            code: WireCode = "internal"
            submission.fail(code, f"the fake engine ({name}) failed")
        finally:
            submission.complete()

    threading.Thread(target=produce, name=f"wsserver-embed-{request.id}", daemon=True).start()
    return submission

"""The per-request and per-sequence state of the batched engine (see :mod:`.llama_engine`).

Prompt cache
------------
A sequence's :attr:`SequenceState.tokens` are the tokens whose KV cells it
holds, by position — updated only when a decode succeeded and rolled back
when one was aborted (:meth:`PromptCache.rollback`), so it is exact.
Finished and cancelled requests leave their cells for the next request with
the same prefix (the next turn of a chat, a regenerate); any other request
removes them first. KV state thus never reaches another request except as a
prefix of its own prompt.

A new request gets the free sequence whose cached tokens share the longest
prefix with its prompt, relative to the prompt's length, if that is above
:data:`PREFIX_SIMILARITY` (llama-server's rule), else the lowest free one
(which keeps the decoding sequences' ids contiguous: with one KV stream per
sequence llama.cpp computes consecutive sequence ids in one micro-batch).
The tail after the common prefix is removed (``llama_memory_seq_rm``) and
only the rest is prefilled — always at least the last prompt token, whose
logits start the completion (:meth:`PromptCache.claim`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llama_cpp

from ..core.logprobs import TokenLogprob
from ..core.protocol import DoneReason
from ..core.textstream import TextAssembler
from ..shaping.reasoning import ReasoningBudget
from .base import CancelEvent, GenerationRequest, Outcome, Sink, Submission

if TYPE_CHECKING:
    from .llama_vision import ImageSpan

__all__ = [
    "PREFIX_SIMILARITY",
    "Job",
    "PromptCache",
    "RequestStats",
    "SequenceState",
    "common_prefix",
]

#: llama-server's ``--slot-prompt-similarity`` default: below this share of
#: the prompt in common, a cached sequence is not worth routing to.
PREFIX_SIMILARITY = 0.1


@dataclass
class RequestStats:
    """What one request cost the engine (read by tests and the benchmark)."""

    prompt_tokens: int = 0
    #: Prompt tokens whose cells came from the prompt cache.
    reused: int = 0
    #: Prompt tokens decoded for it (re-runs after an abort included).
    decoded: int = 0
    sequence: int = -1
    aborted: bool = False
    #: Tokens written instead of sampled to close a think block (its budget spent).
    forced: int = 0


@dataclass(eq=False)
class SequenceState:
    index: int
    #: The tokens whose KV cells this sequence holds, position by position.
    tokens: list[int] = field(default_factory=list)
    job: Job | None = None


@dataclass(eq=False)
class Job:
    request: GenerationRequest
    sink: Sink
    cancel: CancelEvent
    submission: Submission
    stats: RequestStats
    prompt: list[int] = field(default_factory=list)
    max_tokens: int = 0
    seq: SequenceState | None = None
    #: Prompt tokens whose cells are committed (the reused prefix included).
    fed: int = 0
    #: Sampled, its text delivered or held, not yet decoded.
    next_token: int | None = None
    sampler: Any = None
    #: The request's grammar sampler (None: unconstrained), and how many
    #: UTF-8 continuation bytes its output still owes.
    grammar: Any = None
    #: A constrained request's chain is in two parts around the grammar:
    #: ``pre`` (bias, penalties, DRY; None if none) then ``sampler``, which
    #: keeps at most ``keeps`` of the most likely tokens (0: any number).
    pre: Any = None
    keeps: int = 0
    #: Plain greedy (temperature 0, nothing that moves logits, no XTC): the
    #: token is the logits' argmax, read without building a candidate list.
    argmax: bool = False
    utf8_needed: int = 0
    assembler: TextAssembler | None = None
    produced: int = 0
    #: Text the channel has not taken yet (a token's, then perhaps the tail),
    #: with its tokens' count and log-probabilities (if asked for).
    outbox: deque[tuple[str, int, tuple[TokenLogprob, ...]]] = field(default_factory=deque)
    ending: Outcome | None = None
    #: Paused on a full channel; ``when_room`` clears it.
    waiting_room: bool = False
    cancelled: bool = False
    #: Has prompt tokens in the decode in flight (a cancel then aborts it).
    in_flight: bool = False
    started: bool = False
    on_cancel: Callable[[], None] | None = None
    #: The request's reasoning budget (None: none asked, nothing counted), and
    #: the close tag's tokens still to write instead of sampling once it is spent.
    budget: ReasoningBudget | None = None
    forced: deque[int] = field(default_factory=deque)
    #: The prompt's images, in order (:mod:`.llama_vision`), and the
    #: embeddings of the one being decoded (encoded once, decoded over steps).
    media: tuple[ImageSpan, ...] = ()
    embeddings: Any = None

    def text_end(self) -> int:
        """Where the prompt's text from ``fed`` on stops: the next image's
        first position (``fed`` itself inside an image), or the prompt's end."""
        for span in self.media:
            if span.start + span.n_tokens > self.fed:
                return max(span.start, self.fed)
        return len(self.prompt)

    def image_at(self) -> ImageSpan | None:
        """The image holding the next prompt position, if one does."""
        for span in self.media:
            if span.start <= self.fed < span.start + span.n_tokens:
                return span
        return None

    def needs_step(self) -> bool:
        """Whether the engine has work for this job: to let it go (cancelled),
        to deliver its text or its end, to decode its next token or prompt —
        none while it is paused on a full channel."""
        if self.cancelled:
            return True
        if self.waiting_room:
            return False
        if self.outbox or self.ending or self.next_token is not None:
            return True
        return self.fed < len(self.prompt)

    def commit(self, fed: int) -> int:
        """The step decoded the ``fed`` tokens of this job: its sequence holds
        their cells now. Returns how many of them were prompt tokens."""
        assert self.seq is not None
        if self.fed < len(self.prompt):
            self.seq.tokens.extend(self.prompt[self.fed : self.fed + fed])
            self.fed += fed
            self.stats.decoded += fed
            return fed
        assert self.next_token is not None
        self.seq.tokens.append(self.next_token)
        self.next_token = None
        return 0

    def produce(self, token: int, data: bytes, entries: tuple[TokenLogprob, ...]) -> None:
        """A sampled token that is not EOG, its bytes and log-probabilities:
        its text held for the channel, counted in the reasoning budget; a
        stop string or ``max_tokens`` ends the request, else the token is
        the sequence's next to decode."""
        assembler = self.assembler
        assert assembler is not None
        self.produced += 1
        text = assembler.feed(data)
        self.outbox.append((text, 1, entries))
        if self.budget is not None:
            self.budget.feed(text)
        if assembler.stopped:
            self.ending = Outcome(
                "stop",
                len(self.prompt),
                self.produced,
                cached_tokens=self.stats.reused,
                stop_sequence=assembler.stop_string,
            )
        elif self.produced >= self.max_tokens:
            self.finish("length")
        else:
            self.next_token = token

    def finish(self, reason: DoneReason) -> None:
        """End the request for ``reason`` once its text is delivered."""
        assert self.assembler is not None
        # A character cut off by max_tokens is dropped, as create_completion drops it.
        tail = self.assembler.flush()
        if tail:
            self.outbox.append((tail, 0, ()))
        self.ending = Outcome(
            reason, len(self.prompt), self.produced, cached_tokens=self.stats.reused
        )


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """The context's sequences and the KV cells each holds (see the module
    docstring). Used on the engine thread only."""

    def __init__(self, ctx: Any, parallel: int) -> None:
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.sequences = [SequenceState(i) for i in range(parallel)]

    def claim(self, prompt: list[int]) -> tuple[SequenceState, int] | None:
        """A free sequence for ``prompt`` (None: none is free), cut back to
        the prefix of ``prompt`` it holds, and that prefix's length: the
        prompt tokens it need not decode again."""
        seq = self._choose(prompt)
        if seq is None:
            return None
        keep = min(common_prefix(seq.tokens, prompt), len(prompt) - 1)
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq.index, keep, -1):
            keep = 0  # a memory that cannot cut a sequence short
            llama_cpp.llama_memory_seq_rm(self._memory, seq.index, -1, -1)
        del seq.tokens[keep:]
        return seq, keep

    def rollback(self, seq: SequenceState) -> None:
        """Remove the cells a failed or aborted decode may have left beyond
        the sequence's committed tokens (llama.cpp keeps the micro-batches
        it finished)."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq.index, len(seq.tokens), -1)

    def forget(self, seq: SequenceState) -> None:
        """Remove all of the sequence's cells: they may be half-written and
        must never be reused."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq.index, -1, -1)
        seq.tokens.clear()

    def _choose(self, prompt: list[int]) -> SequenceState | None:
        free = [s for s in self.sequences if s.job is None]
        if not free:
            return None
        best = max(free, key=lambda s: common_prefix(s.tokens, prompt))
        if common_prefix(best.tokens, prompt) / len(prompt) > PREFIX_SIMILARITY:
            return best
        return free[0]

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

Beyond the slots, the cells of a sequence about to be given to another
conversation are kept in host memory (:mod:`.llama_host_cache`), and a
prompt that extends a kept state further than any free sequence does has it
restored into the lowest free sequence (:meth:`PromptCache.claim`).

Images
------
An image's positions hold a number derived from its pixels
(:func:`.llama_vision.image_key`), so a prefix that covers an image wholly
is reused like text: the image is neither encoded nor decoded again (the job
starts after it). A prefix that ends *inside* an image's span — the cells a
request cancelled halfway through the image's decode left — is cut back to
the image's start (:func:`whole_images`): its rest would need the whole
image encoded again anyway (the encode, not the decode, is an image's cost),
and with a projector whose image attends to itself non-causally (Gemma 3's)
half an image's cells are not what the whole image makes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llama_cpp

from ..core.logprobs import TokenLogprob
from ..core.protocol import DoneReason
from ..core.textstream import TextAssembler
from ..shaping.reasoning import ReasoningBudget
from .base import CancelEvent, GenerationRequest, Outcome, Sink, Submission
from .llama_host_cache import HostCache, common_prefix
from .llama_speculation import Drafter

if TYPE_CHECKING:
    from .llama_vision import ImageSpan

__all__ = [
    "PREFIX_SIMILARITY",
    "RESTORE_MIN_GAIN",
    "Job",
    "PromptCache",
    "RequestStats",
    "SequenceState",
    "common_prefix",
    "engine_counters",
    "whole_images",
]

log = logging.getLogger("wsserver.llama")

#: llama-server's ``--slot-prompt-similarity`` default: below this share of
#: the prompt in common, a cached sequence is not worth routing to.
PREFIX_SIMILARITY = 0.1

#: A state in host memory is restored only when it gives at least this many
#: prompt tokens more than the free sequence would keep: below it the copy
#: (the whole state, and the sequence's own saved first) is not worth it
#: (docs/llama.md, "Host-memory prompt cache").
RESTORE_MIN_GAIN = 16


@dataclass
class RequestStats:
    """What one request cost the engine (read by tests and the benchmark)."""

    prompt_tokens: int = 0
    #: Prompt tokens whose cells came from the prompt cache.
    reused: int = 0
    #: Of those, tokens restored from host memory (:mod:`.llama_host_cache`).
    restored: int = 0
    #: Images the reused prefix held wholly: neither encoded nor decoded for it.
    images_reused: int = 0
    #: Prompt tokens decoded for it (re-runs after an abort included).
    decoded: int = 0
    sequence: int = -1
    aborted: bool = False
    #: Tokens written instead of sampled to close a think block (its budget spent).
    forced: int = 0
    #: Draft tokens proposed for it and accepted (:mod:`.llama_speculation`).
    drafted: int = 0
    accepted: int = 0


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
    #: Its n-gram drafts (None: it does not speculate), and the draft decoded
    #: beside its next token in the step in flight (:mod:`.llama_speculation`).
    drafter: Drafter | None = None
    draft: list[int] = field(default_factory=list)

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


def whole_images(keep: int, media: Sequence[ImageSpan]) -> int:
    """``keep`` prompt positions, cut back to the start of the image they end
    inside, if they do (see the module docstring)."""
    for span in media:
        if span.start < keep < span.start + span.n_tokens:
            return span.start
    return keep


class PromptCache:
    """The context's sequences and the KV cells each holds (see the module
    docstring), and the states kept beyond them in host memory (``host``;
    None: none kept). Used on the engine thread only."""

    def __init__(self, ctx: Any, parallel: int, host: HostCache | None = None) -> None:
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.sequences = [SequenceState(i) for i in range(parallel)]
        self.host = host
        #: The sliding window of the model's SWA layers (1: none), for :meth:`_usable`.
        self._n_swa = max(1, int(llama_cpp.llama_model_n_swa(llama_cpp.llama_get_model(ctx))))

    def claim(
        self,
        prompt: list[int],
        before_restore: Callable[[int], None] | None = None,
        media: Sequence[ImageSpan] = (),
    ) -> tuple[SequenceState, int, int] | None:
        """A free sequence for ``prompt`` (None: none is free), cut back to
        the prefix of ``prompt`` it holds, that prefix's length — the prompt
        tokens it need not decode again — and how many of them were restored
        from host memory. ``before_restore`` is called with that count just
        before a restore (tests). ``media``: the prompt's images, which a
        kept prefix holds wholly or not at all (:func:`whole_images`)."""
        free = [s for s in self.sequences if s.job is None]
        if not free:
            return None
        seq = self._choose(prompt, free)
        keep = self._usable(seq, self._kept(seq.tokens, prompt, media))
        restored = self._restore(prompt, free[0], keep, before_restore, media)
        if restored:
            seq, keep = free[0], restored
        else:  # (a refused restore emptied free[0], which may be ``seq``)
            keep = self._usable(seq, self._kept(seq.tokens, prompt, media))
            self._save(seq, keep)
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq.index, keep, -1):
            keep = restored = 0  # a memory that cannot cut a sequence short
            llama_cpp.llama_memory_seq_rm(self._memory, seq.index, -1, -1)
        del seq.tokens[keep:]
        return seq, keep, restored

    @staticmethod
    def _kept(tokens: list[int], prompt: list[int], media: Sequence[ImageSpan]) -> int:
        """How much of ``prompt`` cells holding ``tokens`` can give: their
        common prefix, short of the prompt's last token (whose logits start
        the answer), cut back to an image's start."""
        return whole_images(min(common_prefix(tokens, prompt), len(prompt) - 1), media)

    def _restore(
        self,
        prompt: list[int],
        target: SequenceState,
        keep: int,
        before_restore: Callable[[int], None] | None,
        media: Sequence[ImageSpan],
    ) -> int:
        """Restore into ``target`` the host state that extends ``prompt``
        furthest, if it gives at least :data:`RESTORE_MIN_GAIN` tokens more
        than ``keep`` and more than :data:`PREFIX_SIMILARITY` of the prompt;
        the tokens it gives (0: none restored)."""
        found = self.host.best(prompt) if self.host is not None else None
        if found is None:
            return 0
        entry, _ = found
        common = self._kept(entry.tokens, prompt, media)
        if common < keep + RESTORE_MIN_GAIN or common / len(prompt) <= PREFIX_SIMILARITY:
            return 0
        if common < min(entry.least, len(entry.tokens)):
            return 0  # cut that short, its sliding window lacks cells (learnt below)
        assert self.host is not None
        self.host.take(entry)
        self._save(target, 0)  # all of its cells go
        if before_restore is not None:
            before_restore(common)
        if not self.host.restore(entry, target.index):
            log.warning("llama.cpp refused a %d-byte prompt state: prefilling", entry.size)
            self.forget(target)
            return 0
        target.tokens = list(entry.tokens)
        if not self._usable(target, common):
            # A saved state holds its SWA layers' cells for its last window
            # only: cut back further, the next token would miss some.
            pos_min = llama_cpp.llama_memory_seq_pos_min(self._memory, target.index)
            entry.least = int(pos_min) + self._n_swa
            self.host.put_back(entry)
            self.forget(target)
            return 0
        self.host.used(common)
        return common

    def _usable(self, seq: SequenceState, keep: int) -> int:
        """``keep``, or 0 where ``seq``'s cells cannot serve a prompt that
        keeps only that many: cut back, the next token attends in the
        sliding-window layers (Gemma 3's) to the ``n_swa`` positions before
        it, and a sequence restored from host memory holds those layers'
        cells for its last window only (``llama_memory_seq_pos_min``).
        llama-server's check ("forcing full prompt re-processing")."""
        if keep == 0 or keep >= len(seq.tokens):
            return keep  # nothing cut: the window before the end is whole
        pos_min = int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq.index))
        return keep if pos_min <= max(0, keep - self._n_swa) else 0

    def _save(self, seq: SequenceState, keep: int) -> None:
        """Keep ``seq``'s cells in host memory if the prompt it goes to keeps
        less than half of them (llama-server's rule: another conversation)."""
        if self.host is not None and seq.tokens and 2 * keep < len(seq.tokens):
            self.host.save(seq.index, seq.tokens)

    def copy(self, source: SequenceState, upto: int) -> SequenceState | None:
        """A free sequence holding the cells of ``source``'s first ``upto``
        positions, copied within the context (not recomputed); None: none is
        free. With one KV stream per sequence llama.cpp copies whole
        streams only: everything is copied, then the rest cut off."""
        free = [s for s in self.sequences if s.job is None]
        if not free or upto > len(source.tokens):
            return None
        seq = free[0]
        self._save(seq, 0)
        llama_cpp.llama_memory_seq_rm(self._memory, seq.index, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._memory, source.index, seq.index, 0, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, seq.index, upto, -1)
        seq.tokens = source.tokens[:upto]
        return seq

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

    def _choose(self, prompt: list[int], free: list[SequenceState]) -> SequenceState:
        best = max(free, key=lambda s: common_prefix(s.tokens, prompt))
        if common_prefix(best.tokens, prompt) / len(prompt) > PREFIX_SIMILARITY:
            return best
        return free[0]


def engine_counters() -> dict[str, int]:
    """The engine's counters (``BatchEngine.stats``: tests, the bench, metrics), at 0."""
    return {
        "requests": 0,
        "aborts": 0,
        "steps": 0,
        "prompt_tokens_reused": 0,
        # Of those, restored from host memory (the prompt cache beyond the slots).
        "prompt_tokens_restored": 0,
        "prompt_tokens_decoded": 0,
        # Images encoded (llama_vision), and images a reused prefix held
        # wholly (neither encoded nor decoded again).
        "images_encoded": 0,
        "images_reused": 0,
        "max_batch_sequences": 0,
        # Constrained sequences: sampled tokens the grammar rejected, and
        # the tokens it was then asked about (the whole vocabulary each
        # time without Candidates.constrain's shortcut).
        "grammar_rejections": 0,
        "grammar_tokens_asked": 0,
        # Grammar work given up on past its deadline (or its cancel).
        "grammar_abandoned": 0,
        # Speculative decoding: draft tokens decoded, and those accepted.
        "draft_tokens": 0,
        "draft_tokens_accepted": 0,
        # Choices (n > 1) whose first token came from a sibling's prompt (llama_choices).
        "choices_forked": 0,
    }

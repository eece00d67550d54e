"""Speculative decoding with n-gram drafts: prompt lookup (used by :mod:`.llama_engine`).

Theory of operation
-------------------
A decoding sequence that repeats text it has seen — a code listing it is
asked to edit, a quote, an extraction, a greedy model's prose falling into a
loop — can often be predicted from its own context. :class:`Drafter` looks
up the last tokens (the token about to be decoded and the ones before it:
:data:`NGRAM_SIZES`, 12 then 8, the longest that matched) at their latest
earlier occurrence in the sequence's prompt and output, and proposes the
tokens that followed there (a match just before the end is a repeating run,
and the draft repeats it). No second model: the drafts cost a dictionary
look-up.

The engine decodes a sequence's next token and its draft in the same step
as everyone else's tokens, with logits at each position
(:func:`.llama_batching.plan_step`), then :func:`.llama_batching.verify`
samples at each position in turn with the sequence's own sampler chain,
exactly as if the tokens had come one step at a time, and stops at the
first sampled token that differs from the draft: every sampled token is
emitted (the accepted draft and the one after it), and the rejected draft
tokens' cells are removed. For a draft fixed before sampling this is the
standard acceptance rule (accept ``d`` with probability ``p(d)``; on
reject, sample from ``p`` without ``d``) in its simplest form — draw ``x``
from ``p``, accept iff ``x == d`` — so the output has the distribution of
plain decoding; greedy output is the same token for token, and a seeded
chain draws once per emitted token, as without drafts — given the same
logits, which quantized weights' multi-row kernels do not quite give
(docs/llama.md, "Speculative decoding").

A draft costs the step its tokens, and a draft token's output row over the
vocabulary most of all: measured on the default model (2 threads, 262,144
tokens of vocabulary), a step of one token took 16 ms, with 1 draft token
39 ms, with 8 99 ms, with 16 148 ms, with 48 322 ms — a short draft loses
even when every token is accepted, a long one pays only when most of it is.
So drafts come only from long matches (8 tokens or more: chance matches
of 3 or 4 tokens, frequent in prose, cost a step each and were rejected),
and are never shorter than :data:`MIN_DRAFT`: the first is that long, a
draft accepted whole doubles the next (up to ``draft_max``), and a draft
that did not pay (fewer than half of its tokens accepted) halves the next
one (not below :data:`MIN_DRAFT`) and pauses the sequence's drafting for 1,
3, 7, ... steps (up to :data:`MAX_PAUSE`).
docs/llama.md, "Speculative decoding". Sans-I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["INDEX_STEP", "MAX_PAUSE", "MIN_DRAFT", "NGRAM_SIZES", "Drafter", "Drafting"]

#: The n-gram sizes looked up, longest first: a longer match is more likely
#: the same passage (llama-server's ``ngram-simple`` looks up 12); 8 re-aligns
#: a copy eight tokens after an edit. Shorter ones (4, 3) matched by chance in
#: prose often enough to cost more than they won (docs/llama.md,
#: "Speculative decoding").
NGRAM_SIZES = (12, 8)
#: The longest pause (steps without drafting) after drafts that did not pay.
MAX_PAUSE = 64
#: The shortest draft proposed (the first one's length, then doubled while
#: accepted whole, halved not below it when not paid): on a large vocabulary
#: a shorter draft costs about as many steps as it can save (docs/llama.md,
#: "Speculative decoding": 1 + 4 tokens took 75 to 81 ms against 16 ms a step).
MIN_DRAFT = 8
#: History positions indexed in one step at most: ~3 ms of Python on the
#: engine thread here (a 32,768-token prompt at once took 91 ms, a stall of
#: every stream beside it); a longer prompt drafts a few steps later.
INDEX_STEP = 2048
#: Token ids fit in this many bits (llama.cpp's are int32): n-gram keys are
#: their tokens packed into one integer.
_BITS = 32


@dataclass(frozen=True, slots=True)
class Drafting:
    """A model's speculation: drafts of at most ``draft_max`` tokens (0: no
    request speculates) from matches of ``ngram`` tokens or more (12 looked
    up first: :data:`NGRAM_SIZES`; ``backend.llama.draft_ngram``)."""

    draft_max: int = 0
    ngram: int = NGRAM_SIZES[-1]

    def drafter(self) -> Drafter:
        """A new sequence's drafter."""
        longest = NGRAM_SIZES[0]
        return Drafter(
            self.draft_max, (longest, self.ngram) if self.ngram < longest else (self.ngram,)
        )


class Drafter:
    """One sequence's n-gram index, its drafts and how well they did (see the
    module docstring). ``draft_max``: the most tokens one draft proposes;
    ``sizes``: the n-gram sizes looked up, longest first; ``shortest``: the
    shortest draft proposed (:data:`MIN_DRAFT`, at most ``draft_max``)."""

    def __init__(
        self, draft_max: int, sizes: Sequence[int] = NGRAM_SIZES, shortest: int = MIN_DRAFT
    ) -> None:
        self.draft_max = draft_max
        self.shortest = max(1, min(shortest, draft_max))
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        #: For each size: n-gram key -> the position after its latest
        #: occurrence (where its continuation starts).
        self._after: dict[int, dict[int, int]] = {n: {} for n in self.sizes}
        #: History positions indexed so far (the history only grows).
        self._indexed = 0
        #: The next draft's length, and the pause before it (steps).
        self.length = self.shortest
        self.pause = 0
        #: Drafts in a row that did not pay (the pause doubles with each).
        self.misses = 0
        #: Tokens proposed and accepted over the sequence's life.
        self.drafted = 0
        self.accepted = 0

    def propose(self, history: Sequence[int], last: int, limit: int) -> list[int]:
        """A draft of at most ``limit`` tokens to follow ``last`` — the token
        about to be decoded after ``history``, the sequence's committed
        tokens (prompt and output; negative ids are image positions, never
        matched nor drafted). Empty: no match, drafting paused, or room for
        less than the shortest draft."""
        if self.pause > 0:
            self.pause -= 1
            return []
        limit = min(limit, self.length)
        if limit < self.shortest or last < 0:
            return []
        if not self._index(history):
            return []  # the rest next step
        at = self._match(history, last)
        if at is None:
            return []
        # The continuation, up to ``last``; a match that close to the end is a
        # repeating run (a loop, a list's pattern) of period ``end + 1 - at``,
        # and the draft goes on repeating it.
        end = len(history)
        draft: list[int] = []
        for k in range(limit):
            p = at + k
            token = history[p] if p < end else last if p == end else draft[k - (end + 1 - at)]
            if token < 0:
                break
            draft.append(token)
        return draft if len(draft) >= self.shortest else []

    def verified(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` accepted:
        the next draft's length and pause follow (see the module docstring)."""
        self.drafted += drafted
        self.accepted += accepted
        if 2 * accepted >= drafted:  # paid: a draft token costs about half a step's
            self.misses = 0
            if accepted == drafted:
                self.length = min(self.draft_max, 2 * self.length)
            return
        self.misses += 1
        self.length = max(self.shortest, self.length // 2)
        self.pause = min(MAX_PAUSE, (1 << self.misses) - 1)

    def _index(self, history: Sequence[int]) -> bool:
        """Index the n-grams ending at the next history positions not indexed
        yet, at most :data:`INDEX_STEP` of them (a long prompt is indexed over
        several steps, not in one stall of the engine thread): each maps to the
        position after it (the latest occurrence wins). Whether all are."""
        longest = self.sizes[0]
        stop = min(len(history), self._indexed + INDEX_STEP)
        for end in range(self._indexed, stop):
            key = 0
            for n in range(1, min(longest, end + 1) + 1):
                token = history[end - n + 1]
                if token < 0:
                    break
                key = (key << _BITS) | token
                table = self._after.get(n)
                if table is not None:
                    table[key] = end + 1
        self._indexed = stop
        return stop == len(history)

    def _match(self, history: Sequence[int], last: int) -> int | None:
        """Where the continuation of the longest n-gram ending in ``last``
        starts at its latest earlier occurrence (None: no n-gram matched)."""
        keys: dict[int, int] = {}
        key, n = last, 1
        while n < self.sizes[0] and n <= len(history):
            token = history[-n]
            if token < 0:
                break
            key = (key << _BITS) | token
            n += 1
            keys[n] = key
        for size in self.sizes:
            if size in keys and (at := self._after[size].get(keys[size])) is not None:
                return at
        return None

"""How many prompt tokens one step may take while other sequences decode.

A long prompt shares the machine with the sequences that are decoding: each
step carries their next tokens and a chunk of the prompt, and their next
token comes only when the step ends. :class:`PrefillBudget` sizes that chunk
by time, not by a token count: a step that carries prompt tokens lasts at
most ``gap_s`` (``prefill_gap_ms``, 200 ms by default) — the others' worst
pause, a bound a person can feel, in milliseconds — and the prompt gets the
rest of the step. A fixed token count cannot do that: a prompt token's cost
grows with its position (attention reads every earlier cell; measured here
on the default model, 2 threads: ~2 ms at position 0, ~4.6 ms at position
2,900), and differs between models and machines.

When the decoding sequences' own step comes near the bound (many streams, a
slow machine), the step may last ``factor`` (``prefill_budget``, 2.0) times
their decode-only step instead, so the prompt still moves. (Before issue 40
``factor`` was the bound and ``gap_s`` a floor of 80 ms: the others' gap at
most doubled — 90 ms at three streams here — and a 3,000-token prompt
beside them waited 23.5 s for its first token, against llama-server's
7.1 s. Nobody sees a 90 ms pause in streaming text paced at 30 ms a frame;
everybody sees a 23-second wait. docs/llama.md, "The freeze bound".)

It learns from the steps it is told about (:meth:`PrefillBudget.observe`):

* the decode-only step's duration, per number of decoding sequences;
* a prompt token's cost in a mixed step: the step's duration beyond the
  decode-only one, per prompt token. Moving averages that follow the prompt's
  position from step to step; until a mixed step was seen, a prompt-only
  step's cost per token stands in (optimistic: large batches are cheaper per
  token — the next mixed step corrects it).

The budget is a bound, not an average: the room a step leaves the prompt is
cut by :data:`MARGIN` times the mean overrun of the last mixed steps beyond
their predicted durations, so a step that runs long by the machine's usual
scatter still ends within it (on a quiet machine a few milliseconds; never
more than half the room, so a prompt still moves on a machine too noisy to
keep the bound).

Until the decode-only step of (about) that many sequences was measured, a
step takes the fixed chunk (``prefill_chunk``), as it does when both
``factor`` and ``gap_s`` are 0 (the budget off): many short prompts arriving
together get their first tokens quickly, and the budget takes over once the
batch has settled.

Sans-I/O: durations come from the caller — the engine times the whole step,
what the decoding sequences wait for between two tokens (the last step's
tokens delivered, the batch built, decoded and sampled), not ``llama_decode``
alone; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["PrefillBudget"]

#: Weight of the newest observation in the moving averages: a prompt token's
#: cost follows the prompt's position, so recent steps count most.
TOKEN_WEIGHT = 0.5
DECODE_WEIGHT = 0.25
#: The budget is a bound, not an average: a mixed step's room is cut by this
#: many times the mean overrun of the last :data:`MISSES` mixed steps beyond
#: their predicted durations (the machine's noise, and the estimate trailing a
#: cost that grows; a step shorter than predicted counts 0 — an estimate that
#: is too high is no risk), so a step that runs long by the usual amount still
#: ends within it. Six times the mean overrun of normal noise is ~2.4 of its
#: standard deviations.
MARGIN = 6.0
MISSES = 16
#: ... but never below this part of the room: on a machine so noisy that the
#: bound cannot be kept, the prompt must still move.
MIN_ROOM = 0.5


@dataclass
class PrefillBudget:
    """See the module docstring. ``factor`` and ``gap_s`` both 0 turn the
    budget off: every step then takes ``fixed`` prompt tokens (``prefill_chunk``)."""

    factor: float
    n_batch: int
    fixed: int = 64
    #: A mixed step lasts at most this long (seconds), unless ``factor`` times
    #: the decode-only step is longer: the others' worst pause.
    gap_s: float = 0.0
    #: Decode-only step seconds by the number of decoding sequences.
    decode_s: dict[int, float] = field(default_factory=dict)
    #: Seconds one prompt token adds to a mixed step (None: not seen yet).
    token_s: float | None = None
    #: A prompt token's cost in a prompt-only step, the first estimate.
    alone_s: float | None = None
    #: The last budgeted share (its growth from step to step is capped).
    last_share: int = 0
    #: How far the last mixed steps ran beyond their prediction, seconds (0: not).
    misses: deque[float] = field(default_factory=lambda: deque(maxlen=MISSES))
    #: (decode-only step, per prompt token) the last share was sized by.
    _sized_by: tuple[float, float] | None = None

    def share(self, decoding: int) -> int:
        """Prompt tokens the next step may take beside ``decoding`` sequences'
        tokens (all of ``n_batch`` when none decode)."""
        if decoding == 0:
            return self.n_batch
        if self.off:
            return max(1, min(self.fixed, self.n_batch))
        decode = self.decode_time(decoding)
        per_token = self.token_s if self.token_s is not None else self.alone_s
        if decode is None or per_token is None or per_token <= 0:
            # Nothing to size by yet: the fixed chunk, as without a budget.
            return max(1, min(self.fixed, self.n_batch))
        room = max(self.factor * decode, self.gap_s) - decode
        room = max(room - MARGIN * self.miss_s, MIN_ROOM * room)
        share = max(1, min(self.n_batch, int(room / per_token + 1e-6)))
        if self.last_share:  # one quick step (noise) must not make the next one huge
            share = min(share, 2 * self.last_share + 8)
        self.last_share = share
        self._sized_by = (decode, per_token)
        return share

    def room(self, decoding: int) -> float:
        """Seconds of other work a step may carry beside ``decoding``
        sequences' tokens — the room :meth:`share` sizes a prompt's chunk by
        (an embedding decode's, :mod:`.llama_embed`), without changing what it
        learnt. 0 when nothing is measured yet or the budget is off: the
        caller then takes its smallest piece."""
        if self.off or decoding <= 0:
            return 0.0
        decode = self.decode_time(decoding)
        if decode is None:
            return 0.0
        room = max(self.factor * decode, self.gap_s) - decode
        return max(room - MARGIN * self.miss_s, MIN_ROOM * room)

    def draft_rows(self, decoding: int) -> int | None:
        """Draft tokens a decode-only step of ``decoding`` sequences may carry
        in all (:mod:`.llama_speculation`). None, no bound, when one sequence
        decodes (it alone waits for the step, and the drafts are its gain) or
        the budget is off; with others waiting, what fits in the room the gap
        leaves, at a decoding sequence's own cost a token (a draft token
        computes its output row as it does); 0 until that step is measured."""
        if decoding <= 1 or self.off:
            return None
        decode = self.decode_time(decoding)
        if decode is None or decode <= 0:
            return 0
        return int(self.room(decoding) / (decode / decoding))

    def output_tokens(self, decoding: int) -> int:
        """Prompt tokens a prompt's last token is worth beside ``decoding``
        sequences: it computes the logits and samples, as a decoding sequence
        does (on the default model the output row over a 262,144-token
        vocabulary is most of a decoding sequence's part of the step), so the
        step that ends a prompt leaves that much room for it. 0 when nothing
        is measured or the budget is off."""
        if self.off or decoding <= 0:
            return 0
        decode = self.decode_time(decoding)
        per_token = self.token_s if self.token_s is not None else self.alone_s
        if decode is None or per_token is None or per_token <= 0:
            return 0
        return math.ceil(decode / decoding / per_token)

    @property
    def off(self) -> bool:
        """No time budget: a fixed chunk a step (``factor`` and ``gap_s`` 0)."""
        return self.factor <= 0 and self.gap_s <= 0

    @property
    def miss_s(self) -> float:
        """The mean overrun of the last mixed steps beyond their prediction (0: none yet)."""
        return sum(self.misses) / len(self.misses) if self.misses else 0.0

    def decode_time(self, decoding: int) -> float | None:
        """The decode-only step's duration for ``decoding`` sequences: measured
        for that count or one next to it (a step's cost grows slowly with its
        tokens: the weights are read once for all of them), else unknown.
        Not extrapolated further: a step of 16 sequences estimated from one
        of a single sequence would be far too short, every step after it
        would look dear, and the chunks would shrink to a token each (seen:
        16 requests arriving together waited 4.7 s for their first token)."""
        for near in (decoding, decoding - 1, decoding + 1):
            if near in self.decode_s:
                return self.decode_s[near]
        return None

    def observe(self, decoding: int, prompt: int, seconds: float) -> None:
        """A step of ``decoding`` sequences' tokens and ``prompt`` prompt tokens
        took ``seconds``."""
        sized_by, self._sized_by = self._sized_by, None
        if prompt and decoding and sized_by is not None:
            self.misses.append(max(0.0, seconds - (sized_by[0] + prompt * sized_by[1])))
        if prompt == 0:
            if decoding > 0:
                old = self.decode_s.get(decoding)
                self.decode_s[decoding] = (
                    seconds if old is None else old + DECODE_WEIGHT * (seconds - old)
                )
            return
        if decoding == 0:
            per = seconds / prompt
            self.alone_s = (
                per if self.alone_s is None else self.alone_s + TOKEN_WEIGHT * (per - self.alone_s)
            )
            return
        decode = self.decode_time(decoding)
        if decode is None:
            return
        per = max(seconds - decode, 0.0) / prompt
        if self.alone_s is not None:  # noise can make a step look free; no token is
            per = max(per, 0.5 * self.alone_s)
        self.token_s = (
            per if self.token_s is None else self.token_s + TOKEN_WEIGHT * (per - self.token_s)
        )

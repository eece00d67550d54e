"""What an embedding decode costs, learnt from the decodes: a fixed part and a part a token.

An embedding decode beside decoding streams must end within the room the
step leaves (:meth:`.llama_budget.PrefillBudget.room`), so the tokens it
takes are priced before it runs. A cost a token alone (the moving average
this replaced) prices every size alike, and an embedding decode is not
proportional: on the default model (2 threads; ``bench``-style probe,
2026-12-04) a decode of 1 token took 11 ms, of 2 tokens 25, of 16 tokens 73
and of 128 tokens 471 — llama.cpp computes the output head over every
position of an embedding context, and weights are read once a decode. Fitted
over the decodes of a 512-input request beside three streams, the cost was
~70 ms plus 2.9 ms a token, with a scatter of 26 ms: a price learnt from the
128-token decodes that run while nothing else decodes, or from one size of
piece, put pieces of 25 tokens at 140 ms that took up to 257 (the streams'
worst gap then ~310 ms against a 200 ms bound).

So :class:`EmbedCost` fits ``seconds = fixed + per_token * tokens`` by least
squares over the recent decodes (older ones weigh less: ``FORGET`` each
decode), and sizes a decode as :class:`.PrefillBudget` sizes a prompt's
chunk: the room less :data:`~.llama_budget.MARGIN` times the mean overrun
of the last decodes it sized (never below :data:`~.llama_budget.MIN_ROOM` of
the room, so the work still moves on a machine too noisy for the bound).
While every decode so far had one size, the cost is taken as proportional.

Sans-I/O: the caller times its decodes; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from typing import Final

from .llama_budget import MARGIN, MIN_ROOM, MISSES

__all__ = ["EmbedCost"]

#: Weight kept by the earlier decodes at each new one (a half-life of ~7).
FORGET: Final = 0.9


class EmbedCost:
    """See the module docstring."""

    def __init__(self) -> None:
        # Exponentially weighted sums: of weights, x, x², y, x·y (x tokens, y seconds).
        self._sums = [0.0] * 5
        #: How far the last decodes sized for a room ran beyond their price, seconds.
        self.misses: deque[float] = deque(maxlen=MISSES)

    @property
    def measured(self) -> bool:
        """Whether a decode was seen (before: no price, the smallest piece)."""
        return self._sums[0] > 0

    def line(self) -> tuple[float, float] | None:
        """``(fixed, per_token)`` seconds, or None before the first decode."""
        w, x, xx, y, xy = self._sums
        if w <= 0 or x <= 0:
            return None
        proportional = (0.0, y / x)
        spread = w * xx - x * x
        if spread <= 1e-9 * w * xx:  # one size so far: no line through it
            return proportional
        per_token = (w * xy - x * y) / spread
        fixed = (y - per_token * x) / w
        if per_token <= 0 or fixed < 0:  # noise bent the line: fall back
            return proportional
        return fixed, per_token

    def price(self, tokens: int) -> float | None:
        """Seconds a decode of ``tokens`` is expected to take (None: unmeasured)."""
        line = self.line()
        return None if line is None else line[0] + line[1] * tokens

    @property
    def miss_s(self) -> float:
        """The mean overrun of the last decodes sized for a room (0: none yet)."""
        return sum(self.misses) / len(self.misses) if self.misses else 0.0

    def tokens_within(self, room_s: float, most: int) -> int | None:
        """The most tokens (1 to ``most``) whose decode fits ``room_s`` with
        the margin; None while unmeasured."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        room = max(room_s - MARGIN * self.miss_s, MIN_ROOM * room_s)
        return max(1, min(most, int((room - fixed) / per_token + 1e-9)))

    def observe(self, tokens: int, seconds: float, priced: float | None = None) -> None:
        """A decode of ``tokens`` took ``seconds``; ``priced``: what it was
        expected to take when it was sized for a room (its overrun is kept)."""
        if tokens <= 0:
            return
        if priced is not None:
            self.misses.append(max(0.0, seconds - priced))
        sums = [s * FORGET for s in self._sums]
        for k, value in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            sums[k] += value
        self._sums = sums

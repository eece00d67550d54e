"""Log-probabilities from a decoded position's logits (used by :mod:`.llama_engine`).

Computed only for the sequences whose request asked for them, from the raw
logits llama.cpp left for that position — the model's own distribution,
before the sampler chain (see :mod:`wsserver.core.logprobs` for why) — exactly as
llama-cpp-python's ``Llama.logits_to_logprobs`` computes it (a float32
log-softmax), so the two agree. One pass for the normaliser and a partial
sort for the alternatives: the work is proportional to the vocabulary, per
requesting sequence and step, and nothing at all for the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.logprobs import TokenLogprob, TopLogprob, logprob_value, token_text

__all__ = ["LogprobReader"]


class LogprobReader:
    """Turns a position's logits and the sampled token into a :class:`TokenLogprob`."""

    def __init__(self, n_vocab: int, piece: Callable[[int], bytes]) -> None:
        self.n_vocab = n_vocab
        self._piece = piece

    def entry(self, logits: Any, token: int, top: int) -> TokenLogprob:
        """``logits``: llama.cpp's float pointer for the position (read, not kept)."""
        row = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        peak = np.amax(row)
        if not np.isfinite(peak):
            peak = np.float32(0.0)
        shifted = np.subtract(row, peak, dtype=np.single)
        with np.errstate(divide="ignore"):
            normaliser = np.log(np.sum(np.exp(shifted)))
        alternatives: tuple[TopLogprob, ...] = ()
        if top > 0:
            k = min(top, self.n_vocab)
            best = np.argpartition(shifted, self.n_vocab - k)[self.n_vocab - k :]
            # Most likely first; ties by token id, so the order is stable.
            ordered = sorted(best.tolist(), key=lambda t: (-float(shifted[t]), t))
            alternatives = tuple(self._top(t, float(shifted[t] - normaliser)) for t in ordered)
        raw = self._piece(token)
        value = logprob_value(float(shifted[token] - normaliser))
        return TokenLogprob(token_text(raw), value, raw, alternatives)

    def _top(self, token: int, value: float) -> TopLogprob:
        raw = self._piece(token)
        return TopLogprob(token_text(raw), logprob_value(value), raw)

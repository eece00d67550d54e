"""Log-probabilities of generated tokens, as data and on the wires (sans-I/O).

A request that asks for them (``logprobs``, with ``top_logprobs``
alternatives, 0 to :data:`~wsserver.core.sampling.MAX_TOP_LOGPROBS`) gets one
:class:`TokenLogprob` per generated token: the token's text and raw bytes,
its log-probability and the most likely alternatives at that position,
most likely first. Engines make them; they travel with the token's piece
through the channel and the pacing (a coalesced ``delta`` carries the
entries of the tokens it merged) and each dialect writes them in its own
shape: OpenAI's chat ``logprobs.content`` (:meth:`TokenLogprob.to_wire`, also
the WebSocket ``delta``'s), or the legacy completions object
(:func:`legacy_logprobs`).

**Which distribution.** The model's own: the softmax of its logits at that
position, *before* the sampler chain (no penalties, logit bias, grammar,
truncation or temperature). That is what llama-cpp-python's
``create_completion`` and llama-server (by default) report and what OpenAI's
values behave like — a property of the model and the text, comparable across
requests whatever their sampling options. After the chain the numbers would
say little: at temperature 0 the chosen token has probability 1 and every
other ``-inf``, and top-k/top-p/min-p cut the alternatives away. The chosen
token therefore need not be the most likely one (it was sampled, or forced by
a grammar or a bias).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "LOGPROB_FLOOR",
    "MAX_ENTRY_BYTES",
    "TokenLogprob",
    "TopLogprob",
    "entries_size",
    "legacy_logprobs",
    "logprob_value",
    "parse_entries",
    "token_text",
]

#: The lowest log-probability written (OpenAI writes this for "never"); JSON
#: has no ``-inf``.
LOGPROB_FLOOR: Final = -9999.0
#: What one entry holds at most, in bytes, with 20 alternatives and tokens of
#: at most 256 bytes (the channel's per-token bound): its text and raw bytes,
#: each alternative's, and the objects around them.
MAX_ENTRY_BYTES: Final = 21 * (2 * 256 + 64)


def logprob_value(value: float) -> float:
    """A log-probability as written: finite, at most 0, at least the floor."""
    if math.isnan(value) or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(value, 0.0)


def token_text(raw: bytes) -> str:
    """A token's text: its bytes as UTF-8, a partial character as U+FFFD
    (``bytes`` keeps the exact bytes to join)."""
    return raw.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One alternative at a position."""

    token: str
    logprob: float
    bytes: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token: its log-probability and the top alternatives."""

    token: str
    logprob: float
    bytes: bytes
    #: The most likely tokens at this position, most likely first (as many as asked).
    top: tuple[TopLogprob, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """OpenAI's chat shape (``choices[].logprobs.content[]``), also the WebSocket's."""
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": list(self.bytes),
            "top_logprobs": [top.to_wire() for top in self.top],
        }

    def size(self) -> int:
        """The memory this entry holds, roughly (its texts and bytes, plus overhead)."""
        return (
            64
            + len(self.token)
            + len(self.bytes)
            + sum(64 + len(t.token) + len(t.bytes) for t in self.top)
        )


def entries_size(entries: Iterable[TokenLogprob]) -> int:
    return sum(entry.size() for entry in entries)


def legacy_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions object for these tokens; ``offset`` is the
    length of the completion's text before them (``text_offset`` counts from
    there, by the tokens' texts)."""
    tokens: list[str] = []
    offsets: list[int] = []
    for entry in entries:
        tokens.append(entry.token)
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{t.token: t.logprob for t in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def parse_entries(value: Any) -> tuple[TokenLogprob, ...]:
    """Entries from the chat shape (a WebSocket ``delta``'s, an upstream's
    ``logprobs.content``). Raises ``ValueError`` on anything else."""
    if not isinstance(value, list):
        raise ValueError("logprobs must be a list")
    return tuple(_entry(item) for item in value)


def _entry(item: Any) -> TokenLogprob:
    token, logprob, raw = _alternative(item)
    tops = item.get("top_logprobs") or []
    if not isinstance(tops, list):
        raise ValueError("top_logprobs must be a list")
    top = tuple(TopLogprob(*_alternative(t)) for t in tops)
    return TokenLogprob(token, logprob, raw, top)


def _alternative(item: Any) -> tuple[str, float, bytes]:
    if not isinstance(item, dict):
        raise ValueError("a logprob entry must be an object")
    token, logprob, raw = item.get("token"), item.get("logprob"), item.get("bytes")
    if not isinstance(token, str):
        raise ValueError("a logprob entry's token must be a string")
    if isinstance(logprob, bool) or not isinstance(logprob, int | float):
        raise ValueError("a logprob entry's logprob must be a number")
    if raw is None:
        data = token.encode()
    elif isinstance(raw, list) and all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in raw
    ):
        data = bytes(raw)
    else:
        raise ValueError("a logprob entry's bytes must be a list of bytes")
    return token, logprob_value(float(logprob)), data

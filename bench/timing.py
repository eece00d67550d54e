"""Timing: one streamed answer as its client saw it, contenders side by side, statistics.

Every client of the harness — the lean WebSocket client, the SSE clients, the
bundled client, llama-cpp-python in-process — records a :class:`Stream`: the
``perf_counter`` times of its send, of each piece of text and of its end.
Sections run their contenders in rounds with :func:`side_by_side`, the order
turning every round so that drift on this noisy machine hits all of them
alike, and reduce the rounds with the statistics below: medians, percentiles,
and ratios or differences taken per round (a pair) before their median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import psutil

now = time.perf_counter

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass
class Stream:
    """One streamed answer: when it was sent, when each piece arrived, when it ended."""

    #: Taken when the record is made: make it just before the request is sent.
    sent: float = field(default_factory=now)
    #: Over HTTP: when the response's head arrived.
    head: float | None = None
    first: float | None = None
    last: float | None = None
    end: float | None = None
    pieces: int = 0
    #: Completion tokens, where the server counted them (0: not counted).
    tokens: int = 0
    parts: list[str] = field(default_factory=list)
    #: Each piece's arrival, kept when a section asks (``arrivals=[]``).
    arrivals: list[float] | None = None
    #: The answer's last frame or event (a ``done`` frame, llama-server's final chunk).
    final: dict[str, Any] = field(default_factory=dict)

    def piece(self, text: str) -> None:
        at = now()
        if self.first is None:
            self.first = at
        self.last = at
        self.pieces += 1
        self.parts.append(text)
        if self.arrivals is not None:
            self.arrivals.append(at)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def since_sent(self, at: float | None) -> float | None:
        """Seconds from the send to ``at``."""
        return None if at is None else at - self.sent

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first is None else 1000 * (self.first - self.sent)

    def decode_tps(self, tokens: int | None = None, *, to_end: bool = False) -> float | None:
        """Tokens after the first over the time from the first piece to the last
        (``to_end``: to the end of the answer)."""
        n = tokens if tokens is not None else self.tokens
        last = self.end if to_end else self.last
        if n < 2 or self.first is None or last is None or last <= self.first:
            return None
        return (n - 1) / (last - self.first)


# ------------------------------------------------------------------ rounds

Order = Literal["rotate", "flip", "fixed"]


def running_order(names: Sequence[K], round_: int, order: Order = "rotate") -> list[K]:
    """The contenders' order in round ``round_``: rotated by one each round,
    flipped every other round, or always the same."""
    if order == "rotate":
        shift = round_ % len(names)
        return [*names[shift:], *names[:shift]]
    if order == "flip" and round_ % 2:
        return list(reversed(names))
    return list(names)


async def side_by_side(
    rounds: int,
    contenders: Mapping[K, Callable[[int], Awaitable[T]]],
    *,
    order: Order = "rotate",
    skip: int = 0,
) -> dict[K, list[T]]:
    """Each contender's ``measure(round)`` in every round, in :func:`running_order`
    order; the results by contender. The first ``skip`` rounds warm up: they
    run, and are not kept."""
    results: dict[K, list[T]] = {name: [] for name in contenders}
    for round_ in range(rounds):
        for name in running_order(list(contenders), round_, order):
            result = await contenders[name](round_)
            if round_ >= skip:
                results[name].append(result)
    return results


# ------------------------------------------------------------------ statistics


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values measured (None: not measured), if any."""
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def summary(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, p99, min, max and count of the values measured (None: not measured)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"n": 0, "median": None, "p99": None, "min": None, "max": None}
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "p99": percentile(vals, 99),
        "min": min(vals),
        "max": max(vals),
    }


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def pair_ratios(values: Iterable[float | None], bases: Iterable[float | None]) -> list[float]:
    """``value / base`` of each pair (the same round) where both were measured."""
    return [v / b for v, b in zip(values, bases, strict=True) if v and b]


def pair_deltas(values: Iterable[float | None], bases: Iterable[float | None]) -> list[float]:
    """``value - base`` of each pair (the same round) where both were measured."""
    return [v - b for v, b in zip(values, bases, strict=True) if v is not None and b is not None]


def median_round(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round with the median ``key`` (its other figures with it), every
    round's ``key`` beside it and the median in place."""
    ranked = sorted(rounds, key=lambda r: r[key])
    out = dict(ranked[len(ranked) // 2])
    out["rounds"] = [r[key] for r in rounds]
    out[key] = statistics.median(r[key] for r in rounds)
    return out


def aggregate(streams: Iterable[Stream], t0: float, *, to_end: bool = False) -> dict[str, Any]:
    """Streams run together, from ``t0``: their completion tokens over the time
    to the last piece of any (``to_end``: to the last end)."""
    runs = list(streams)
    tokens = sum(s.tokens for s in runs)
    end = max((s.end if to_end else s.last) or s.sent for s in runs) - t0
    return {"tok_s": tokens / end, "tokens": tokens}


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


#: A streamed answer's line → (text came in it, the token count it reports or None).
LineRead = Callable[[bytes], tuple[bool, int | None]]


async def streamed_post(http: Any, url: str, body: Any, read: LineRead) -> tuple[float, float]:
    """POST ``body`` (an aiohttp session's) and read the streamed answer line
    by line: (seconds from sending to the first text, tokens per second from
    the first text to the end, by the count the answer reports)."""
    t0 = now()
    first: float | None = None
    tokens = 0
    async with http.post(url, json=body) as response:
        async for line in response.content:
            text, counted = read(line)
            if counted is not None:
                tokens = counted
            elif text and first is None:
                first = now()
    assert first is not None and tokens, f"{url}: no text, or no token count"
    return first - t0, tokens / max(now() - first, 1e-9)

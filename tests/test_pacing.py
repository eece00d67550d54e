"""Frame pacing decisions, sans-I/O, on a fake clock."""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsserver.core.pacing import Coalescer


def drive(pacing: Coalescer, arrivals: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """Feed one-token pieces at their arrival times the way the sender does, and
    flush whenever a flush is due (also between arrivals, at the deadline).
    Returns the frames as (time, text); what is left goes out at the end."""
    frames: list[tuple[float, str]] = []
    now = 0.0
    for at, text in arrivals:
        # Between arrivals the sender waits until the deadline, then flushes.
        while pacing.has_text and not pacing.due(now) and pacing.deadline() <= at:
            now = pacing.deadline()
        if pacing.due(now):
            frames.append((now, pacing.take(now)[0]))
        now = at
        pacing.add(text, 1)
        if pacing.due(now):
            frames.append((now, pacing.take(now)[0]))
    if pacing.pending:
        frames.append((now, pacing.take(now)[0]))
    return frames


def test_first_text_is_due_at_once() -> None:
    pacing = Coalescer(flush_window=1.0, flush_tokens=100)
    assert not pacing.due(0.0)
    pacing.add("a", 1)
    assert pacing.due(0.0)
    assert pacing.take(0.0) == ("a", 1)
    assert not pacing.pending


def test_an_unlimited_producer_gets_one_frame_per_window() -> None:
    # A token every 10 µs for one second (100,000 tokens/s), a 30 ms window,
    # flush_tokens 5: before, the count made a frame every 50 µs.
    pacing = Coalescer(flush_window=0.03, flush_tokens=5)
    arrivals = [(n * 1e-5, f"{n} ") for n in range(100_000)]
    frames = drive(pacing, arrivals)
    sends = [t for t, _ in frames[:-1]]  # the last is the end-of-request flush
    assert sends[0] == 0.0
    gaps = [b - a for a, b in pairwise(sends)]
    assert min(gaps) >= 0.03 - 1e-9
    assert len(frames) <= 1 + 1 / 0.03 + 1
    assert "".join(text for _, text in frames) == "".join(text for _, text in arrivals)


def test_count_makes_text_go_when_the_ceiling_allows() -> None:
    pacing = Coalescer(flush_window=0.03, flush_tokens=5)
    pacing.add("first", 1)
    pacing.take(10.0)
    for n in range(5):
        pacing.add(str(n), 1)
    # Five tokens pending, but the previous delta was 1 ms ago: the ceiling holds.
    assert not pacing.due(10.001)
    assert pacing.deadline() == pytest.approx(10.03)
    assert not pacing.due(10.0299)
    assert pacing.due(10.03)
    assert pacing.take(10.03) == ("01234", 5)


def test_fewer_tokens_wait_out_their_own_window() -> None:
    pacing = Coalescer(flush_window=0.03, flush_tokens=5)
    pacing.add("first", 1)
    pacing.take(10.0)
    # A lone token long after the previous delta: it gathers company for a window.
    pacing.add(" b", 1)
    assert not pacing.due(11.0)
    assert pacing.deadline() == pytest.approx(11.03)
    pacing.add(" c", 1)
    assert not pacing.due(11.02)
    assert pacing.due(11.03)
    assert pacing.take(11.03) == (" b c", 2)
    # A window that has started moves up to the ceiling once the count is reached.
    pacing.add("x", 1)
    assert not pacing.due(11.04)
    assert pacing.deadline() == pytest.approx(11.07)
    for _ in range(4):
        pacing.add("y", 1)
    assert pacing.deadline() == pytest.approx(11.06)
    assert pacing.due(11.06)


def test_flush_tokens_1_sends_as_early_as_the_ceiling_allows() -> None:
    pacing = Coalescer(flush_window=0.03, flush_tokens=1)
    pacing.add("first", 1)
    pacing.take(10.0)
    pacing.add(" late", 1)
    assert pacing.due(11.0)  # the previous delta is long past: at once
    pacing.take(11.0)
    pacing.add(" soon", 1)
    assert not pacing.due(11.01)
    assert pacing.due(11.03)


def test_zero_window_flushes_everything_at_once() -> None:
    pacing = Coalescer(flush_window=0.0, flush_tokens=5)
    pacing.add("a", 1)
    pacing.take(1.0)
    pacing.add("b", 1)
    assert pacing.due(1.0)


def test_held_back_tokens_are_counted_but_do_not_flush_alone() -> None:
    pacing = Coalescer(flush_window=0.0, flush_tokens=1)
    pacing.add("", 3)
    assert pacing.pending and not pacing.due(5.0)
    pacing.add("x", 1)
    assert pacing.has_text
    assert pacing.take(5.0) == ("x", 4)


def test_invalid_settings() -> None:
    with pytest.raises(ValueError):
        Coalescer(flush_window=-1, flush_tokens=1)
    with pytest.raises(ValueError):
        Coalescer(flush_window=0, flush_tokens=0)


@settings(max_examples=200, deadline=None)
@given(
    window_ms=st.integers(min_value=0, max_value=100),
    flush_tokens=st.integers(min_value=1, max_value=20),
    gaps_us=st.lists(st.integers(min_value=0, max_value=200_000), min_size=1, max_size=300),
)
def test_ceiling_wait_and_order_hold_for_any_arrivals(
    window_ms: int, flush_tokens: int, gaps_us: list[int]
) -> None:
    window = window_ms / 1000
    pacing = Coalescer(flush_window=window, flush_tokens=flush_tokens)
    arrivals: list[tuple[float, str]] = []
    at = 0.0
    for n, gap in enumerate(gaps_us):
        at += gap / 1e6
        arrivals.append((at, f"<{n}>"))
    frames = drive(pacing, arrivals)
    assert "".join(text for _, text in frames) == "".join(text for _, text in arrivals)
    assert all(text for _, text in frames)
    sends = [t for t, _ in frames[:-1]]
    # The ceiling: no two deltas closer than the window (but the final flush).
    for a, b in pairwise(sends):
        assert b - a >= window - 1e-9
    # The wait: no text waits longer than its window (arrivals are when the
    # sender first sees them in drive()); the first goes at once.
    assert frames[0][0] == arrivals[0][0]
    ends = list(accumulate(len(text) for _, text in frames))
    position = 0
    for arrived, text in arrivals:
        frame_time = frames[bisect_right(ends, position)][0]
        assert frame_time - arrived <= window + 1e-9
        position += len(text)


def test_a_full_frame_takes_no_more_until_it_is_sent() -> None:
    pacing = Coalescer(flush_window=0.03, flush_tokens=5, max_chars=10)
    pacing.add("first", 1)
    assert pacing.due(0.0)
    pacing.take(0.0)
    pacing.add("abcdefgh", 1)
    assert not pacing.full
    pacing.add("ij", 1)
    assert pacing.full
    # Full is not due: the ceiling still holds, the frame waits for its window.
    assert not pacing.due(0.01)
    assert pacing.due(0.03)
    assert pacing.take(0.03) == ("abcdefghij", 2)
    assert not pacing.full

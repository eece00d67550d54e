"""Frame pacing decisions, sans-I/O."""

from __future__ import annotations

import pytest

from wsserver.pacing import Coalescer


def test_first_text_is_due_at_once() -> None:
    pacing = Coalescer(flush_window=1.0, flush_tokens=100)
    assert not pacing.due(0.0)
    pacing.add("a", 1)
    assert pacing.due(0.0)
    assert pacing.take(0.0) == ("a", 1)
    assert not pacing.pending


def test_window_then_count() -> None:
    pacing = Coalescer(flush_window=0.03, flush_tokens=5)
    pacing.add("first", 1)
    pacing.take(10.0)
    pacing.add("b", 1)
    pacing.add("c", 1)
    assert not pacing.due(10.01)
    assert pacing.deadline() == pytest.approx(10.03)
    assert pacing.due(10.03)
    pacing.take(10.03)
    for n in range(5):
        pacing.add(str(n), 1)
    assert pacing.due(10.031)  # five tokens: due before the window
    assert pacing.take(10.031) == ("01234", 5)


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

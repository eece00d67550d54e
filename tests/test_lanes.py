"""A connection's lanes (sans-I/O): one request at a time per lane, lanes side by side, two caps."""

from __future__ import annotations

import pytest

from wsserver.core.lanes import LaneLimit, Lanes


def test_a_new_lane_starts_its_request_at_once_a_busy_one_queues_it_in_order() -> None:
    lanes: Lanes[str] = Lanes(max_lanes=8, max_pending=16)
    assert lanes.add("a", "a1") == "a1"
    assert lanes.add(None, "n1") == "n1"  # no stream_id is a lane too
    assert lanes.add("a", "a2") is None
    assert lanes.add("a", "a3") is None
    assert len(lanes) == 2
    assert lanes.done("a") == "a2"
    assert lanes.done("a") == "a3"
    assert lanes.done("a") is None  # it has run its last request: gone
    assert len(lanes) == 1
    assert lanes.add("a", "a4") == "a4"  # the key seen again: a new lane
    assert lanes.done(None) is None
    assert lanes.done("a") is None
    assert len(lanes) == 0


def test_the_lanes_cap_counts_lanes_running_and_frees_with_them() -> None:
    lanes: Lanes[int] = Lanes(max_lanes=2, max_pending=16)
    assert lanes.add("a", 1) == 1
    assert lanes.add("b", 2) == 2
    with pytest.raises(LaneLimit) as refused:
        lanes.add("c", 3)
    assert refused.value.which == "lanes"
    assert lanes.add("a", 4) is None  # an open lane still takes requests
    assert lanes.done("b") is None
    assert lanes.add("c", 3) == 3


def test_the_pending_cap_counts_what_waits_behind_the_running_request() -> None:
    lanes: Lanes[int] = Lanes(max_lanes=8, max_pending=2)
    assert lanes.add("a", 0) == 0  # running: not waiting
    assert lanes.add("a", 1) is None
    assert lanes.add("a", 2) is None
    with pytest.raises(LaneLimit) as refused:
        lanes.add("a", 3)
    assert refused.value.which == "pending"
    assert lanes.done("a") == 1  # a refused request changed nothing
    assert lanes.add("a", 3) is None
    assert [lanes.done("a"), lanes.done("a"), lanes.done("a")] == [2, 3, None]


def test_a_dropped_lane_forgets_what_waits_in_it() -> None:
    lanes: Lanes[int] = Lanes(max_lanes=1, max_pending=4)
    assert lanes.add("a", 0) == 0
    lanes.add("a", 1)
    lanes.add("a", 2)
    assert lanes.drop("a") == 2
    assert lanes.drop("a") == 0
    assert len(lanes) == 0
    assert lanes.add("b", 5) == 5  # its place is free

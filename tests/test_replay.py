"""Resuming, sans-I/O: the replay tail, the session's detach/adopt, the frames."""

from __future__ import annotations

import json

import orjson
import pytest
from conftest import CLIENT_FRAME, SERVER_FRAME

from wsserver.core.events import (
    DoneDelivered,
    Finished,
    ModelGranted,
    Outcome,
    ProducerExited,
    TextProduced,
)
from wsserver.core.protocol import (
    Cancel,
    Delta,
    Done,
    Generate,
    Limits,
    Restart,
    Resume,
    Resumed,
    Started,
    parse_client_frame,
    parse_server_frame,
    serialize,
)
from wsserver.core.replay import ReplayTail
from wsserver.core.session import Send, Session, StartGeneration
from wsserver.errors import ProtocolError

LIMITS = Limits()


def parse(obj: object) -> object:
    return parse_client_frame(json.dumps(obj), LIMITS)


def frames(effects: list[object]) -> list[object]:
    return [e.frame for e in effects if isinstance(e, Send)]


# ---------------------------------------------------------------- frames


def test_resume_frames_parse_and_match_the_schema() -> None:
    cases = {
        '{"type":"generate","id":"a","prompt":"x","resumable":true}': Generate(
            id="a", prompt="x", resumable=True
        ),
        '{"type":"resume","id":"a","resume_token":"t","after_seq":-1}': Resume("a", "t", -1),
        '{"type":"cancel","id":"a","resume_token":"t"}': Cancel(id="a", resume_token="t"),
        '{"type":"restart","id":"a","new_id":"b","resumable":false}': Restart(
            id="a", new_id="b", overrides={"resumable": False}
        ),
    }
    for data, frame in cases.items():
        assert parse_client_frame(data, LIMITS) == frame
        CLIENT_FRAME.validate(json.loads(data))


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "generate", "id": "a", "prompt": "x", "resumable": 1},
        {"type": "resume", "id": "a", "resume_token": "t"},
        {"type": "resume", "id": "a", "resume_token": "t", "after_seq": -2},
        {"type": "resume", "id": "a", "resume_token": "t", "after_seq": True},
        {"type": "resume", "id": "a", "resume_token": "", "after_seq": 0},
        {"type": "resume", "id": "a", "resume_token": "x" * 129, "after_seq": 0},
        {"type": "resume", "id": "a", "resume_token": "t", "after_seq": 0, "more": 1},
        {"type": "cancel", "id": "a", "resume_token": 5},
    ],
)
def test_bad_resume_frames_are_refused(obj: dict[str, object]) -> None:
    with pytest.raises(ProtocolError) as info:
        parse(obj)
    assert info.value.code == "bad_request"
    assert not CLIENT_FRAME.is_valid(obj)


@pytest.mark.parametrize(
    "frame", [Started(id="a", resume_token="tok"), Resumed(id="a", after_seq=-1)]
)
def test_resume_server_frames_match_the_schema_and_round_trip(frame: object) -> None:
    data = serialize(frame)  # type: ignore[arg-type]
    SERVER_FRAME.validate(orjson.loads(data))
    assert parse_server_frame(data) == frame


def test_started_without_a_token_is_unchanged_on_the_wire() -> None:
    assert orjson.loads(serialize(Started(id="a"))) == {"type": "started", "id": "a"}


# ---------------------------------------------------------------- the tail


def test_the_tail_keeps_the_newest_deltas_within_its_budget() -> None:
    one = len(serialize(Delta(id="a", seq=0, text="xxxx")))
    tail = ReplayTail(budget=3 * one)
    for seq in range(5):
        tail.add(Delta(id="a", seq=seq, text="xxxx"))
        assert tail.bytes <= tail.budget
    # The request's record keeps the next seq (5); the tail only the frames.
    assert (tail.first_seq(5), len(tail)) == (2, 3)
    assert [d.seq for d in tail.after(1, 5, "a")] == [2, 3, 4]
    assert [d.seq for d in tail.after(3, 5, "a")] == [4]
    assert tail.after(4, 5, "a") == []
    for bad in (0, 5, 100):
        with pytest.raises(ProtocolError) as info:
            tail.after(bad, 5, "a")
        assert info.value.code == "seq_out_of_range"


def test_an_empty_tail_takes_only_minus_one() -> None:
    tail = ReplayTail(budget=1000)
    assert tail.after(-1, 0, "a") == []
    with pytest.raises(ProtocolError):
        tail.after(0, 0, "a")


def test_a_delta_larger_than_the_budget_is_not_kept() -> None:
    tail = ReplayTail(budget=10)
    tail.add(Delta(id="a", seq=0, text="much too long for the budget"))
    assert (tail.bytes, len(tail), tail.first_seq(1)) == (0, 0, 1)
    assert tail.after(0, 1, "a") == []


# ---------------------------------------------------------------- the session


def running(session: Session, request_id: str, token: str | None = "tok") -> None:
    request = Generate(id=request_id, prompt="p")
    assert session.handle(request, 0.0) == [StartGeneration(request)]
    assert frames(session.handle(ModelGranted(request_id, token), 0.5)) == [
        Started(id=request_id, resume_token=token)
    ]


def test_detach_and_adopt_carry_seq_timings_and_the_replay() -> None:
    old = Session()
    running(old, "a")
    old.handle(TextProduced("a", "one ", 1), 1.0)
    old.handle(TextProduced("a", "two ", 1), 1.1)
    parked = old.detach("a")
    assert parked is not None and parked.next_seq == 2 and not parked.finished
    assert old.active_id is None and old._producer is None
    assert parked.record.resume_token == "tok" and parked.held_bytes() > 0

    new = Session()
    effects = new.adopt(parked, 0, 2.0)
    assert frames(effects) == [Resumed(id="a", after_seq=0), Delta(id="a", seq=1, text="two ")]
    assert new.active_id == "a" and new._producer == "a"
    assert frames(new.handle(TextProduced("a", "three", 1), 2.1)) == [
        Delta(id="a", seq=2, text="three")
    ]
    (done,) = frames(new.handle(Finished("a", Outcome("length")), 3.0))
    assert isinstance(done, Done)
    assert done.usage.completion_tokens == 3
    assert round(done.timings.ttft_ms or 0) == 1000  # timing-ok: test clock; the old connection
    # Its input came along: it can be restarted here.
    assert new.handle(ProducerExited("a"), 3.5) == []
    restarted = new.handle(Restart(id="a", new_id="b"), 4.0)
    assert isinstance(restarted[-1], StartGeneration)


def test_adopt_is_refused_without_touching_anything() -> None:
    old = Session()
    running(old, "a")
    old.handle(TextProduced("a", "x", 1), 1.0)
    parked = old.detach("a")
    assert parked is not None
    busy = Session()
    running(busy, "b", token=None)
    with pytest.raises(ProtocolError) as info:
        busy.adopt(parked, 0, 2.0)
    assert info.value.code == "busy"
    fresh = Session()
    with pytest.raises(ProtocolError) as info:
        fresh.adopt(parked, 7, 2.0)
    assert info.value.code == "seq_out_of_range"
    assert fresh.active_id is None
    assert frames(fresh.adopt(parked, -1, 2.0))[1] == Delta(id="a", seq=0, text="x")


def test_only_a_running_resumable_request_detaches() -> None:
    session = Session()
    running(session, "plain", token=None)
    assert session.detach("plain") is None
    assert session.active_id == "plain"
    assert session.detach("nobody") is None
    waiting = Session()
    waiting.handle(Generate(id="w", prompt="p"), 0.0)
    assert waiting.detach("w") is None


def test_a_finished_request_whose_done_was_lost_resumes_to_its_done() -> None:
    old = Session()
    running(old, "a")
    old.handle(TextProduced("a", "all", 1), 1.0)
    (done,) = frames(old.handle(Finished("a", Outcome("stop")), 1.5))
    parked = old.detach("a")
    assert parked is not None and parked.finished
    busy = Session()
    running(busy, "b", token=None)
    # Finished: adopting it starts nothing, so a busy session may take it.
    effects = busy.adopt(parked, -1, 2.0)
    assert frames(effects) == [
        Resumed(id="a", after_seq=-1),
        Delta(id="a", seq=0, text="all"),
        done,
    ]
    assert busy.active_id == "b"
    assert parked.cancelled_done(3.0) is done  # its one done, never a second


def test_a_parked_request_cancelled_by_token_gets_one_done() -> None:
    old = Session()
    running(old, "a")
    old.handle(TextProduced("a", "x", 3), 1.0)
    parked = old.detach("a")
    assert parked is not None
    done = parked.cancelled_done(2.0)
    assert done.reason == "cancelled" and done.usage.completion_tokens == 3
    assert round(done.timings.total_ms) == 2000  # timing-ok: the test's own clock values


def test_a_delivered_done_frees_the_tail() -> None:
    session = Session()
    running(session, "a")
    session.handle(TextProduced("a", "text", 1), 1.0)
    assert session.resume_bytes > 0
    frames(session.handle(Finished("a", Outcome("stop")), 1.5))
    assert session.resume_bytes > 0  # kept until the done is known to be out
    session.handle(DoneDelivered("a"), 0.0)
    assert session.resume_bytes == 0
    assert session.detach("a") is None

"""The per-connection state machine, sans-I/O: every transition, races included."""

from __future__ import annotations

from wsserver.core.events import (
    Finished,
    ModelGranted,
    Outcome,
    ProducerExited,
    PromptCounted,
    QueuePosition,
    Rejected,
    TextProduced,
)
from wsserver.core.protocol import Cancel, Delta, Done, Error, Generate, Queued, Restart, Started
from wsserver.core.session import (
    RequestState,
    Send,
    Session,
    StartGeneration,
    StopGeneration,
)
from wsserver.errors import ProtocolError


def gen(request_id: str, prompt: str = "p", **kw: object) -> Generate:
    return Generate(id=request_id, prompt=prompt, **kw)  # type: ignore[arg-type]


def frames(effects: list[object]) -> list[object]:
    return [e.frame for e in effects if isinstance(e, Send)]


def error_code(effects: list[object]) -> str:
    (frame,) = frames(effects)
    assert isinstance(frame, Error)
    return frame.code


def run_to_running(session: Session, request_id: str, now: float = 0.0) -> None:
    assert session.handle(gen(request_id), now) == [StartGeneration(gen(request_id))]
    assert session.handle(ModelGranted(request_id), now + 0.001) == [Send(Started(id=request_id))]


# ---------------------------------------------------------------- happy path


def test_generate_runs_streams_and_finishes_with_one_done() -> None:
    session = Session()
    assert session.handle(gen("a"), 10.0) == [StartGeneration(gen("a"))]
    assert session.state_of("a") is RequestState.WAITING
    assert session.handle(QueuePosition("a", 2), 0.0) == [Send(Queued(id="a", position=2))]
    assert session.handle(QueuePosition("a", 2), 0.0) == []  # unchanged position: nothing to send
    assert session.handle(QueuePosition("a", 1), 0.0) == [Send(Queued(id="a", position=1))]
    assert session.handle(ModelGranted("a"), 10.5) == [Send(Started(id="a"))]
    assert session.state_of("a") is RequestState.RUNNING
    session.handle(PromptCounted("a", 7), 0.0)
    assert (
        session.handle(TextProduced("a", "", 1), 10.6) == []
    )  # held-back bytes: counted, not sent
    assert session.handle(TextProduced("a", "Hel", 1), 10.7) == [
        Send(Delta(id="a", seq=0, text="Hel"))
    ]
    assert session.handle(TextProduced("a", "lo", 2), 10.8) == [
        Send(Delta(id="a", seq=1, text="lo"))
    ]
    (done,) = frames(session.handle(Finished("a", Outcome("length", 7, 4)), 11.5))
    assert isinstance(done, Done)
    assert done.reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (7, 4)
    assert round(done.timings.queued_ms) == 500
    assert round(done.timings.ttft_ms or 0) == 700
    assert round(done.timings.total_ms) == 1500
    assert round(done.timings.tokens_per_s) == 4
    assert session.state_of("a") is RequestState.DONE
    assert session.active_id is None
    # The producer is still the one that must stop before anything else starts.
    assert session._producer == "a"
    assert session.handle(ProducerExited("a"), 11.6) == []
    assert session._producer is None


def test_nothing_is_emitted_for_a_request_after_its_done() -> None:
    session = Session()
    run_to_running(session, "a")
    assert session.handle(Finished("a", Outcome("stop")), 1.0) != []
    assert session.handle(TextProduced("a", "late", 1), 1.1) == []
    assert session.handle(Finished("a", Outcome("length")), 1.2) == []
    assert session.handle(ModelGranted("a"), 1.3) == []
    assert session.handle(QueuePosition("a", 1), 0.0) == []


def test_unknown_state_for_never_seen_ids() -> None:
    assert Session().state_of("x") is None


# ---------------------------------------------------------------- refusals


def test_generate_while_running_is_busy_and_touches_nothing() -> None:
    session = Session()
    run_to_running(session, "a")
    effects = session.handle(gen("b"), 1.0)
    assert error_code(effects) == "busy"
    assert frames(effects)[0].id == "b"  # type: ignore[attr-defined]
    assert session.active_id == "a"
    assert session.handle(TextProduced("a", "x", 1), 1.1) != []


def test_duplicate_ids_are_refused_even_after_done() -> None:
    session = Session()
    run_to_running(session, "a")
    session.handle(Finished("a", Outcome("stop")), 1.0)
    session.handle(ProducerExited("a"), 1.0)
    assert error_code(session.handle(gen("a"), 2.0)) == "duplicate_id"


def test_id_memory_is_bounded() -> None:
    session = Session(id_memory=3)
    for n in range(5):
        request_id = f"r{n}"
        run_to_running(session, request_id)
        session.handle(Finished(request_id, Outcome("stop")), 1.0)
        session.handle(ProducerExited(request_id), 1.0)
    # The oldest ids were forgotten; the recent ones are still refused.
    assert isinstance(session.handle(gen("r0"), 3.0)[0], StartGeneration)
    session.handle(Cancel("r0"), 3.0)
    session.handle(ProducerExited("r0"), 3.0)
    assert error_code(session.handle(gen("r4"), 3.0)) == "duplicate_id"


def test_cancel_of_unknown_or_finished_id() -> None:
    session = Session()
    assert error_code(session.handle(Cancel("nope"), 0.0)) == "unknown_id"
    run_to_running(session, "a")
    session.handle(Finished("a", Outcome("length")), 1.0)
    assert error_code(session.handle(Cancel("a"), 1.1)) == "unknown_id"


def test_cancel_of_another_id_never_touches_the_running_one() -> None:
    session = Session()
    run_to_running(session, "a")
    assert error_code(session.handle(Cancel("b"), 1.0)) == "unknown_id"
    assert session.active_id == "a"


def test_refuse_turns_a_parse_error_into_an_error_frame() -> None:
    from wsserver.errors import ProtocolError

    effects = Session().refuse(ProtocolError("bad_json", "nope"))
    assert frames(effects) == [Error(id=None, code="bad_json", message="nope")]


# ---------------------------------------------------------------- cancel


def test_cancel_running_sends_done_at_once_and_stops_the_producer() -> None:
    session = Session()
    run_to_running(session, "a")
    session.handle(PromptCounted("a", 5), 0.0)
    session.handle(TextProduced("a", "abc", 3), 0.5)
    effects = session.handle(Cancel("a"), 1.0)
    assert effects[0] == StopGeneration("a")
    (done,) = frames(effects)
    assert isinstance(done, Done) and done.reason == "cancelled"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 3)
    assert session.active_id is None and session._producer == "a"


def test_cancel_while_waiting_for_the_model() -> None:
    session = Session()
    session.handle(gen("a"), 0.0)
    session.handle(QueuePosition("a", 3), 0.0)
    effects = session.handle(Cancel("a"), 1.0)
    assert effects[0] == StopGeneration("a")
    done = frames(effects)[0]
    assert isinstance(done, Done) and done.reason == "cancelled"
    assert done.timings.ttft_ms is None and done.timings.tokens_per_s == 0.0
    assert session.handle(ModelGranted("a"), 1.1) == []  # a late grant of the model is ignored


def test_next_request_waits_until_the_old_producer_has_stopped() -> None:
    session = Session()
    run_to_running(session, "a")
    session.handle(Cancel("a"), 1.0)
    # Accepted (the client saw done), but not started while "a" still runs.
    assert session.handle(gen("b"), 1.1) == []
    assert session.active_id == "b"
    assert session._producer == "a"
    # Late reports from "a" are dropped; "b" starts only when "a" is gone.
    assert session.handle(TextProduced("a", "late", 1), 1.2) == []
    assert session.handle(ProducerExited("b"), 1.25) == []  # not b's producer: ignored
    assert session.handle(ProducerExited("a"), 1.3) == [StartGeneration(gen("b"))]
    assert session._producer == "b"


def test_cancel_of_a_deferred_request_needs_no_stop() -> None:
    session = Session()
    run_to_running(session, "a")
    session.handle(Cancel("a"), 1.0)
    session.handle(gen("b"), 1.1)
    effects = session.handle(Cancel("b"), 1.2)
    assert [type(e) for e in effects] == [Send]
    assert frames(effects)[0].reason == "cancelled"  # type: ignore[attr-defined]
    # When "a" finally stops nothing starts: "b" is over.
    assert session.handle(ProducerExited("a"), 1.3) == []
    assert session._producer is None


def test_cancel_racing_the_natural_end_yields_one_done_either_way() -> None:
    # The end first: the cancel is refused.
    session = Session()
    run_to_running(session, "a")
    assert session.handle(Finished("a", Outcome("length")), 1.0) != []
    assert error_code(session.handle(Cancel("a"), 1.0)) == "unknown_id"
    # The cancel first: the end is dropped.
    session = Session()
    run_to_running(session, "b")
    effects = session.handle(Cancel("b"), 1.0)
    assert len([f for f in frames(effects) if isinstance(f, Done)]) == 1
    assert session.handle(Finished("b", Outcome("length")), 1.0) == []


# ---------------------------------------------------------------- restart


def test_restart_running_cancels_old_then_runs_new_with_old_input() -> None:
    session = Session()
    old = gen("a", prompt="story", seed=3, max_tokens=100)
    session.handle(old, 0.0)
    session.handle(ModelGranted("a"), 0.1)
    effects = session.handle(Restart("a", "b", {"max_tokens": 5}), 1.0)
    assert effects[0] == StopGeneration("a")
    assert frames(effects)[0].id == "a"  # type: ignore[attr-defined]
    assert frames(effects)[0].reason == "cancelled"  # type: ignore[attr-defined]
    assert len(effects) == 2  # the start of b waits for a's producer
    assert session.handle(ProducerExited("a"), 1.1) == [
        StartGeneration(Generate(id="b", prompt="story", seed=3, max_tokens=5))
    ]


def test_restart_after_done_regenerates_at_once() -> None:
    session = Session()
    run_to_running(session, "a")
    session.handle(Finished("a", Outcome("stop")), 1.0)
    session.handle(ProducerExited("a"), 1.0)
    assert session.handle(Restart("a", "b"), 2.0) == [StartGeneration(gen("b"))]


def test_restart_refusals() -> None:
    session = Session(restart_memory=2)
    assert error_code(session.handle(Restart("ghost", "n"), 0.0)) == "unknown_id"
    run_to_running(session, "a")
    assert error_code(session.handle(Restart("a", "a"), 0.1)) == "duplicate_id"
    session.handle(Finished("a", Outcome("stop")), 0.2)
    session.handle(ProducerExited("a"), 0.2)
    session.handle(gen("b"), 0.3)
    # "b" runs: restarting "a" would need a second active request.
    assert error_code(session.handle(Restart("a", "c"), 0.4)) == "busy"
    session.handle(Cancel("b"), 0.5)
    session.handle(ProducerExited("b"), 0.5)
    assert isinstance(session.handle(Restart("b", "e"), 0.7)[0], StartGeneration)
    # Only the last two inputs (b, e) are remembered with restart_memory=2.
    session.handle(Cancel("e"), 0.8)
    session.handle(ProducerExited("e"), 0.8)
    assert error_code(session.handle(Restart("a", "d"), 0.9)) == "unknown_id"


def test_rapid_restarts_chain_without_overlap() -> None:
    session = Session()
    run_to_running(session, "r0")
    effects = session.handle(Restart("r0", "r1"), 1.0)
    assert effects[0] == StopGeneration("r0")
    effects = session.handle(Restart("r1", "r2"), 1.1)
    # r1 never started: cancelling it needs no stop, just its done.
    assert [type(e) for e in effects] == [Send]
    assert frames(effects)[0].id == "r1"  # type: ignore[attr-defined]
    assert session.handle(ProducerExited("r0"), 1.2) == [StartGeneration(gen("r2"))]


# ---------------------------------------------------------------- failures


def test_error_outcome_carries_its_code() -> None:
    session = Session()
    run_to_running(session, "a")
    (done,) = frames(
        session.handle(
            Finished("a", Outcome("error", error_code="stalled", error_message="slow")), 1.0
        )
    )
    assert done is not None and done.error_code == "stalled" and done.reason == "error"


def test_a_producer_that_exits_without_an_end_still_yields_one_done() -> None:
    session = Session()
    run_to_running(session, "a")
    effects = session.handle(ProducerExited("a"), 1.0)
    (done,) = frames(effects)
    assert isinstance(done, Done) and done.reason == "error" and done.error_code == "internal"
    assert session.handle(Finished("a", Outcome("stop")), 1.1) == []


def test_reject_forgets_a_request_without_done() -> None:
    session = Session()
    session.handle(gen("a"), 0.0)
    full = ProtocolError("overloaded", "the queue is full", "a")
    assert (
        error_code(session.handle(Rejected("a", full), 0.0)) == "overloaded"
    )  # an error, not a done
    assert session.active_id is None and session._producer is None
    assert session.handle(ProducerExited("a"), 0.1) == []
    # The id stays used.
    assert error_code(session.handle(gen("a"), 0.2)) == "duplicate_id"
    # Rejecting something that is not waiting does nothing.
    run_to_running(session, "b")
    session.handle(Rejected("b", ProtocolError("overloaded", "the queue is full", "b")), 0.0)
    assert session.active_id == "b"


def test_restart_memory_is_bounded_by_bytes_and_keeps_the_newest() -> None:
    from wsserver.core.session import input_size

    big = "🙂" * 10_000  # 4 bytes a character in memory
    session = Session(restart_memory=16, restart_bytes=100_000)
    for n in range(5):
        request = Generate(id=f"r{n}", prompt=big + str(n))
        session.handle(request, 0.0)
        session.handle(ProducerExited(f"r{n}"), 0.0)
        session.handle(Cancel(id=f"r{n}"), 0.0)
    assert session.restart_bytes <= 100_000
    assert session.restart_bytes == 2 * input_size(Generate(id="x", prompt=big + "0"))
    # The two newest can be restarted, the older ones are forgotten.
    assert _restart_error(session, "r4", "n4") is None
    assert _restart_error(session, "r1", "n1") == "unknown_id"
    # A single input larger than the budget is still kept: it is the newest.
    tiny = Session(restart_bytes=10)
    tiny.handle(Generate(id="a", prompt=big), 0.0)
    assert tiny.restart_bytes == input_size(Generate(id="a", prompt=big))


def _restart_error(session: Session, old: str, new: str) -> str | None:
    effects = session.handle(Restart(id=old, new_id=new), 0.0)
    errors = [e.frame.code for e in effects if isinstance(e, Send) and isinstance(e.frame, Error)]
    return errors[0] if errors else None


# ---------------------------------------------------------------- the table


def test_the_documented_transition_table_is_the_one_the_session_reads() -> None:
    import textwrap

    from wsserver.core import transitions

    rendered = textwrap.indent(transitions.render_transitions(), "    ")
    assert transitions.__doc__ is not None
    assert rendered in transitions.__doc__, "regenerate the table: render_transitions()"


def test_every_row_names_a_handler_of_the_session() -> None:
    from wsserver.core.transitions import TRANSITIONS

    for (state, event), row in TRANSITIONS.items():
        assert callable(getattr(Session, row.handler, None)), (state, event, row)
    # Every event a request can receive has at least one row.
    kinds = {event for _, event in TRANSITIONS}
    assert {Generate, Cancel, Restart} <= kinds

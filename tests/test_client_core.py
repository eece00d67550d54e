"""wsserver_client.core, the sans-I/O part of both Python clients: frames in, state out.

No socket and no loop: messages are serialized server frames, fed to a
RequestTable as the clients' I/O layers feed them.
"""

from __future__ import annotations

import pytest
from wsserver_client.core import (
    GenerationError,
    Reasoning,
    Request,
    RequestTable,
    Text,
    ToolCallDelta,
)

from wsserver.core.protocol import (
    Delta,
    Done,
    DoneReason,
    Error,
    Hello,
    Limits,
    Queued,
    ServerFrame,
    Started,
    Timings,
    Usage,
    serialize,
)
from wsserver.shaping.tool_calls import CallPart


def wire(frame: ServerFrame) -> bytes:
    return serialize(frame)


def done(request_id: str, reason: DoneReason = "length") -> bytes:
    return wire(
        Done(
            id=request_id,
            reason=reason,
            usage=Usage(prompt_tokens=1, completion_tokens=2),
            timings=Timings(queued_ms=0.0, ttft_ms=1.0, total_ms=2.0, tokens_per_s=1.0),
        )
    )


def table_with(*ids: str) -> tuple[RequestTable[Request], list[Request]]:
    table: RequestTable[Request] = RequestTable()
    requests = []
    for request_id in ids:
        rid, frame = table.generate_frame("p", None, request_id, {"max_tokens": 3})
        requests.append(table.add(Request(rid, frame)))
    return table, requests


def drain(request: Request) -> list[str]:
    out = []
    while (text := request.take()) is not None:
        out.append(text)
    return out


def test_frames_are_built_with_fresh_ids() -> None:
    table: RequestTable[Request] = RequestTable()
    a, frame = table.generate_frame(None, [{"role": "user", "content": "hi"}], None, {"seed": 1})
    b, _ = table.generate_frame("x", None, None, {})
    assert a != b
    assert frame == {
        "type": "generate",
        "id": a,
        "seed": 1,
        "messages": [{"role": "user", "content": "hi"}],
    }
    new, restart = table.restart_frame(a, None, {"max_tokens": 5})
    assert restart == {"type": "restart", "id": a, "new_id": new, "max_tokens": 5}
    assert table.cancel_frame("zz") == (None, {"type": "cancel", "id": "zz"})


def test_text_flows_in_order_and_done_ends_the_request() -> None:
    table, (request,) = table_with("a")
    assert table.receive(wire(Queued(id="a", position=2))) is request
    assert table.receive(wire(Started(id="a"))) is request
    for seq, text in enumerate(["Hel", "lo"]):
        table.receive(wire(Delta(id="a", seq=seq, text=text)))
    assert request.ready and not request.ended
    assert drain(request) == ["Hel", "lo"]
    assert not request.ready
    table.receive(done("a"))
    assert request.ended and request.finished
    assert request.positions == [2] and request.started
    assert request.finished_result().text == "Hello"
    assert table.live == {}
    # Anything later for that ID is a late frame: dropped.
    assert table.receive(wire(Delta(id="a", seq=2, text="late"))) is None
    assert request.text == "Hello"


def test_pieces_is_iteration_without_the_waiting() -> None:
    """What both clients' iterators run on: text, None (wait), then the end."""
    table, (request, failing) = table_with("a", "b")
    pieces, failing_pieces = request.pieces(), failing.pieces()
    assert next(pieces) is None  # nothing yet: the I/O layer waits until ready
    table.receive(wire(Delta(id="a", seq=0, text="Hi")))
    assert next(pieces) == "Hi"
    table.receive(done("a"))
    assert list(pieces) == []
    table.receive(wire(Error(id="b", code="busy", message="one at a time")))
    with pytest.raises(GenerationError):
        next(failing_pieces)


def test_nothing_of_an_abandoned_request_reaches_the_caller() -> None:
    table, (request,) = table_with("a")
    table.receive(wire(Delta(id="a", seq=0, text="read")))
    assert request.take() == "read"
    table.receive(wire(Delta(id="a", seq=1, text="unread")))
    cancelled, _ = table.cancel_frame("a")
    assert cancelled is request and request.abandoned
    # Neither the text received but not read, nor text still on the wire.
    assert request.take() is None and request.ended
    table.receive(wire(Delta(id="a", seq=2, text="on the wire")))
    assert request.take() is None
    assert "on the wire" not in request.text
    table.receive(done("a", "cancelled"))
    assert request.done is not None and request.done.reason == "cancelled"


def test_restart_abandons_the_old_request() -> None:
    table, (old,) = table_with("a")
    table.receive(wire(Started(id="a")))
    table.restart_frame(old, "b", {})
    assert old.abandoned and old.ended
    table.receive(wire(Delta(id="a", seq=0, text="late")))
    assert old.take() is None and old.text == ""


def test_a_refused_cancel_leaves_the_request_running() -> None:
    table, (request,) = table_with("a")
    table.receive(wire(Started(id="a")))
    table.cancel_frame("a")
    table.receive(wire(Error(id="a", code="rate_limited", message="slow down")))
    assert not request.finished
    table.receive(done("a"))
    assert request.done is not None


def test_error_frames_fail_their_request_or_are_kept() -> None:
    table, (request, other) = table_with("a", "b")
    table.receive(wire(Error(id="a", code="busy", message="one at a time")))
    assert request.ended
    with pytest.raises(GenerationError) as info:
        request.raise_for_error()
    assert (info.value.code, info.value.request_id) == ("busy", "a")
    with pytest.raises(GenerationError):
        request.finished_result()
    assert not other.finished
    table.receive(wire(Error(id=None, code="bad_json", message="?")))
    assert [e.code for e in table.errors] == ["bad_json"]


def test_a_lost_connection_fails_every_live_request() -> None:
    table, (a, b) = table_with("a", "b")
    b.abandon()
    table.lost("connection closed: 1006")
    assert table.live == {}
    assert a.error is not None and a.error.code == "connection_lost"
    with pytest.raises(GenerationError):
        a.raise_for_error()
    b.raise_for_error()  # an abandoned request ends quietly


def test_the_first_frame_must_be_hello() -> None:
    table: RequestTable[Request] = RequestTable()
    hello = table.hello_from(wire(Hello(model="m", server="s", limits=Limits())))
    assert table.hello is hello and hello.model == "m"
    with pytest.raises(GenerationError):
        table.hello_from(wire(Started(id="a")))


def test_the_core_does_no_io() -> None:
    """Its imports, read from the source: the package's __init__ imports the
    async client, so importing the core pulls in asyncio either way."""
    import ast
    import inspect

    import wsserver_client.core

    tree = ast.parse(inspect.getsource(wsserver_client.core))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"asyncio", "websockets", "socket", "threading", "selectors"}, imported
    assert "wsserver" in imported  # the frames come from wsserver.core.protocol


def test_reasoning_text_and_call_parts_become_typed_events_in_order() -> None:
    table, (request,) = table_with("a")
    table.receive(wire(Delta(id="a", seq=0, text="", reasoning="Hmm, ")))
    table.receive(
        wire(
            Delta(
                id="a",
                seq=1,
                text="Sure.",
                reasoning="rain?",
                tool_calls=(CallPart(0, '{"city": ', "call_1", "weather"),),
            )
        )
    )
    table.receive(
        wire(
            Delta(
                id="a",
                seq=2,
                text="",
                tool_calls=(CallPart(0, '"Oslo"}'), CallPart(1, "[1", "call_2", "sum")),
            )
        )
    )
    events = []
    while (event := request.take_event()) is not None:
        events.append(event)
    weather, total = request.tool_calls
    assert events == [
        Reasoning("Hmm, "),
        Reasoning("rain?"),
        Text("Sure."),
        ToolCallDelta(weather, '{"city": '),
        ToolCallDelta(weather, '"Oslo"}'),
        ToolCallDelta(total, "[1"),
    ]
    assert request.reasoning == "Hmm, rain?" and request.text == "Sure."
    assert (weather.id, weather.name, weather.arguments) == (
        "call_1",
        "weather",
        '{"city": "Oslo"}',
    )
    assert weather.parsed_arguments == {"city": "Oslo"} and weather.arguments_error is None
    # A call cut short (cancelled mid-call) says why its arguments do not parse.
    assert total.parsed_arguments is None
    assert total.arguments_error is not None and "not valid JSON" in total.arguments_error
    total.arguments = "[1]"
    assert total.arguments_error == "the arguments are JSON but not an object: list"
    table.receive(done("a", "tool_calls"))
    result = request.finished_result()
    assert result.tool_calls == [weather, total] and result.reasoning == "Hmm, rain?"
    assert result.message()["content"] == "Sure."
    # The loop goes on: its reasoning goes back with the calls.
    assert result.message()["reasoning"] == "Hmm, rain?"
    assert result.message()["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }


def test_reading_the_text_passes_over_reasoning_and_calls() -> None:
    table, (request,) = table_with("a")
    table.receive(wire(Delta(id="a", seq=0, text="", reasoning="thinking")))
    table.receive(wire(Delta(id="a", seq=1, text="An", reasoning="more")))
    table.receive(wire(Delta(id="a", seq=2, text="swer")))
    assert drain(request) == ["An", "swer"]
    table.receive(wire(Delta(id="a", seq=3, text="", reasoning="late")))
    assert request.ready and request.take() is None and not request.ready
    table.receive(done("a", "stop"))
    assert request.ended and list(request.pieces()) == []
    assert request.reasoning == "thinkingmorelate"

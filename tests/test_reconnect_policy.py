"""The reconnect/resume policy, row by row of clients/reconnect-policy.json.

The same table drives the JS client's test (clients/js/test/reconnect-policy.test.js,
run by tests/test_js_node.py), so the Python and JS clients wait, keep, resume,
retry and give up alike. Each row is checked on the policy's plain functions
(:mod:`wsserver_client.reconnect`) and through the
:class:`~wsserver_client.core.RequestTable` that both Python clients drive.
Plain synchronous pytest: a clock and draws of our own, no loop, no sleeps.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any

import pytest
from conftest import ROOT
from wsserver_client import reconnect
from wsserver_client.client import Client as AsyncClient
from wsserver_client.core import Request, RequestTable
from wsserver_client.reconnect import ReconnectPolicy
from wsserver_client.sync import Client as SyncClient

from wsserver.core.protocol import Delta, Error, Resumed, Started, serialize

TABLE: dict[str, Any] = json.loads((ROOT / "clients" / "reconnect-policy.json").read_text())


def rows(section: str, keep: Callable[[dict[str, Any]], bool] = lambda row: True) -> Any:
    chosen = [(i, row) for i, row in enumerate(TABLE[section]) if keep(row)]
    return pytest.mark.parametrize(
        "row", [row for _, row in chosen], ids=[f"{i}-{row['why']}" for i, row in chosen]
    )


class Clock:
    """The table's clock: it says what the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table_at(clock: Clock, draw: float = 0.0) -> RequestTable[Request]:
    return RequestTable(clock=clock, draw=lambda: draw)


def started(table: RequestTable[Request], token: str | None = "tok", last_seq: int = -1) -> Request:
    """A live request ``r1`` that started (with ``token``) and received seq 0..last_seq."""
    request_id, frame = table.generate_frame("p", None, "r1", {"resumable": token is not None})
    request = table.add(Request(request_id, frame))
    table.receive(serialize(Started(id="r1", resume_token=token)))
    for seq in range(last_seq + 1):
        table.receive(serialize(Delta(id="r1", seq=seq, text=f"<{seq}>")))
    return request


def expected_wait(row: dict[str, Any]) -> Any:
    """A ``waits`` row's wait (as near as floats go), or ``None``: given up."""
    return None if row["wait_s"] is None else pytest.approx(row["wait_s"], abs=1e-9)


def assert_kept_or_given_up(
    table: RequestTable[Request], request: Request, row: dict[str, Any], code: str
) -> None:
    if row["wait_s"] is None:
        assert request.error is not None and request.error.code == code
        assert table.live == {}
    else:
        assert request.error is None and table.live == {"r1": request}


def test_the_numbers_are_the_tables() -> None:
    assert dataclasses.asdict(ReconnectPolicy()) == TABLE["policy"]
    assert TABLE["gave_up"] == {
        "reconnecting": reconnect.RECONNECT_GAVE_UP,
        "resuming": reconnect.RESUME_GAVE_UP,
    }
    # Both clients' reconnect_timeout defaults to the policy's budget.
    for client_class in (AsyncClient, SyncClient):
        client = client_class("ws://127.0.0.1:9/")
        assert client.reconnect_timeout == ReconnectPolicy().timeout_s
        assert client.requests.policy == ReconnectPolicy()


@rows("waits")
def test_the_wait_before_each_try(row: dict[str, Any]) -> None:
    wait = ReconnectPolicy().wait(row["attempt"], row["elapsed_s"], row["draw"])
    assert wait == expected_wait(row)


@rows("waits")
def test_the_wait_before_each_reconnect(row: dict[str, Any]) -> None:
    """Through the table: the reconnect's waits, or the kept request given up."""
    clock = Clock()
    table = table_at(clock, row["draw"])
    request = started(table)
    table.lost("connection closed", keep_resumable=True)
    waits = table.reconnect_waits()
    for _ in range(row["attempt"] - 1):
        next(waits)  # the tries before, all at once (the clock stands still)
    clock.now = row["elapsed_s"]
    assert next(waits, None) == expected_wait(row)
    assert_kept_or_given_up(table, request, row, TABLE["gave_up"]["reconnecting"])


# (A resume is not refused thousands of times within the budget: those rows
# are the reconnect's.)
@rows("waits", lambda row: row["attempt"] <= 100)
def test_the_wait_before_asking_again_after_a_refused_resume(row: dict[str, Any]) -> None:
    """Through the table: the ``attempt``-th refusal, ``elapsed_s`` after the loss."""
    clock = Clock()
    table = table_at(clock, row["draw"])
    request = started(table)
    table.lost("connection closed", keep_resumable=True)
    for _ in range(row["attempt"]):
        table.resume_frame(request)
        table.receive(serialize(Error(id="r1", code="already_attached", message="held")))
    assert request.retry_resume
    clock.now = row["elapsed_s"]
    assert table.retry_wait(request) == expected_wait(row)
    assert_kept_or_given_up(table, request, row, TABLE["gave_up"]["resuming"])


@rows("losses")
def test_what_a_lost_connection_keeps(row: dict[str, Any]) -> None:
    resumable = row["resume_token"] is not None
    assert reconnect.keeps_on_loss(resumable, reconnecting=row["reconnecting"]) is row["kept"]
    table = table_at(Clock())
    request = started(table, row["resume_token"])
    if row["abandoned"]:
        table.cancel_frame("r1")
    kept = table.lost("connection closed", keep_resumable=row["reconnecting"])
    if row["kept"]:
        assert kept == [request] and request.suspended and request.error is None
    else:
        assert kept == [] and table.live == {}
        assert request.error is not None and request.error.code == "connection_lost"


@rows("resumes")
def test_what_a_kept_request_sends_on_the_new_connection(row: dict[str, Any]) -> None:
    r = row["request"]
    frame = reconnect.resume_frame(
        r["id"], r["resume_token"], r["last_seq"], abandoned=r["abandoned"]
    )
    assert frame == row["frame"]
    table = table_at(Clock())
    request = started(table, r["resume_token"], r["last_seq"])
    if r["abandoned"]:
        table.cancel_frame("r1")
    table.lost("connection closed", keep_resumable=True)
    assert table.resume_frames() == [row["frame"]]
    # A resume waits for the server's answer; a cancel waits for its done.
    assert request.resuming is not r["abandoned"]


@rows("errors")
def test_which_errors_about_a_resume_are_retried(row: dict[str, Any]) -> None:
    assert reconnect.retries_refusal(row["code"], resuming=row["resuming"]) is row["retried"]
    table = table_at(Clock())
    request = started(table)
    table.lost("connection closed", keep_resumable=True)
    if row["resuming"]:
        table.resume_frame(request)
    table.receive(serialize(Error(id="r1", code=row["code"], message="no")))
    if row["retried"]:
        assert request.retry_resume and request.error is None and table.live == {"r1": request}
    else:
        assert not request.retry_resume and table.live == {}
        assert request.error is not None and request.error.code == row["code"]


def test_the_budget_runs_from_the_first_loss_until_the_resume_is_accepted() -> None:
    """Lost again before the server's ``resumed``: the first loss still counts."""
    clock = Clock()
    table = table_at(clock)
    request = started(table)
    table.lost("connection closed", keep_resumable=True)
    clock.now = 20.0
    table.resume_frame(request)
    table.lost("connection closed again", keep_resumable=True)
    assert request.lost_at == 0.0
    # Resumed: a later loss starts a new budget.
    table.resume_frame(request)
    table.receive(serialize(Resumed(id="r1", after_seq=-1)))
    assert not request.suspended and request.resume_attempts == 0
    clock.now = 25.0
    table.lost("connection closed once more", keep_resumable=True)
    assert request.lost_at == 25.0


@pytest.mark.parametrize("module", ["wsserver_client.reconnect", "wsserver_client.base"])
def test_the_policy_and_the_shared_client_do_no_io(module: str) -> None:
    """Read from the source, as test_client_core.py reads the core's."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    imported = {
        ((node.module if isinstance(node, ast.ImportFrom) else alias.name) or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not imported & {"asyncio", "websockets", "socket", "threading", "selectors", "time"}

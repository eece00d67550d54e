"""The reconnect/resume policy of every wsserver client, as numbers and plain functions.

The asyncio and the sync Python client follow it through
:class:`~wsserver_client.core.RequestTable`, which calls these functions; the
JS client (``clients/js/wsserver.js``, its ``RECONNECT_DEFAULTS`` and
``reconnectPolicy``) follows the same numbers and the same decisions.
``clients/reconnect-policy.json`` is the table of situations and expected
decisions that the tests of both languages run their code against
(``tests/test_reconnect_policy.py``, ``clients/js/test/reconnect-policy.test.js``),
so the two cannot drift apart.

Theory of operation
-------------------
**A lost connection** is a decision per live request (:func:`keeps_on_loss`):
a resumable one (its ``started`` carried a ``resume_token``) is kept when the
client will reconnect; any other fails with ``connection_lost``, because the
server has forgotten it and sending it again could run it twice.

**Reconnecting.** While a request is kept, the client reconnects: try ``n``
(1, 2, …) first waits :meth:`ReconnectPolicy.delay` ``(n)``. On the new
connection every kept request gets :func:`resume_frame`: ``resume`` with
``after_seq``, the last ``seq`` it received, or ``cancel`` with its token if
the caller gave it up meanwhile (else the server would hold it until its grace
ran out).

**A refused resume.** The server answers ``already_attached`` while it has not
yet noticed that the old connection is gone. :func:`retries_refusal` says that
refusal is retried, after the same backoff (the ``n``-th refusal waits
``delay(n)``); any other error about a ``resume`` fails the request.

**Giving up.** One budget bounds every wait for a request: a try that would
start more than :attr:`ReconnectPolicy.timeout_s` after the request's
connection was lost is not made (:meth:`ReconnectPolicy.wait`), and the
request fails with :data:`RECONNECT_GAVE_UP` (no connection in time) or
:data:`RESUME_GAVE_UP` (the server kept refusing the resume).

The numbers and why they are these are in docs/protocol.md, "Resuming a
stream"; :class:`ReconnectPolicy` says it in short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RECONNECT_GAVE_UP",
    "RESUME_GAVE_UP",
    "ReconnectPolicy",
    "keeps_on_loss",
    "resume_frame",
    "retries_refusal",
]

#: The error code of a kept request when no connection could be made in time.
RECONNECT_GAVE_UP = "connection_lost"
#: The error code of a kept request when the server refused its resume to the end.
RESUME_GAVE_UP = "already_attached"


@dataclass(frozen=True, slots=True)
class ReconnectPolicy:
    """The backoff between tries and the budget for them, in seconds.

    The defaults are the policy. The waits start small because a dropped
    connection usually comes straight back (a proxy reload, a Wi-Fi hand-over,
    a server-side abort) and the reader is watching a stopped stream; they are
    not zero, and are jittered, so that the clients one server restart dropped
    together do not knock in the same millisecond. They double to a cap of one
    second: a client learns that the server is back at most a second late, and
    one connection attempt a second is no load. The budget is the server's
    default ``stream.resume_grace_s``: after it, a detached request is gone.
    """

    #: The wait before the first try.
    first_delay_s: float = 0.1
    #: Each wait is this many times the one before…
    factor: float = 2.0
    #: …up to this.
    max_delay_s: float = 1.0
    #: Up to this fraction of each wait is taken off at random.
    jitter: float = 0.25
    #: A try that would start later than this after the request's connection
    #: was lost is not made: the request fails. The clients'
    #: ``reconnect_timeout``.
    timeout_s: float = 30.0

    def delay(self, attempt: int, draw: float) -> float:
        """The wait before try ``attempt`` (1, 2, …); ``draw``, in [0, 1), picks
        how much jitter comes off."""
        try:
            base = self.first_delay_s * self.factor ** (attempt - 1)
        except OverflowError:  # thousands of tries: long past the cap anyway
            base = math.inf
        return min(self.max_delay_s, base) * (1.0 - self.jitter * draw)

    def wait(self, attempt: int, elapsed_s: float, draw: float) -> float | None:
        """The wait before try ``attempt``, ``elapsed_s`` after the connection
        was lost — or ``None``: give up, that try would start after
        :attr:`timeout_s`."""
        delay = self.delay(attempt, draw)
        return delay if elapsed_s + delay <= self.timeout_s else None


def keeps_on_loss(resumable: bool, *, reconnecting: bool) -> bool:
    """Whether a live request survives a lost connection, to be resumed: only
    a resumable one (it has a ``resume_token`` and has not finished), and only
    if the client reconnects. Any other fails with ``connection_lost``."""
    return resumable and reconnecting


def resume_frame(
    request_id: str, resume_token: str, last_seq: int, *, abandoned: bool
) -> dict[str, Any]:
    """What a kept request sends on the new connection: ``resume`` after the
    last ``seq`` received (-1: none yet), or, if the caller abandoned it while
    the connection was down, ``cancel`` with its token."""
    if abandoned:
        return {"type": "cancel", "id": request_id, "resume_token": resume_token}
    return {"type": "resume", "id": request_id, "resume_token": resume_token, "after_seq": last_seq}


def retries_refusal(code: str, *, resuming: bool) -> bool:
    """Whether an ``error`` about a request is retried rather than failing it:
    only ``already_attached`` in answer to our ``resume`` (the server has not
    yet seen the old connection go)."""
    return resuming and code == "already_attached"

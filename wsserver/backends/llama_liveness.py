"""Whether the batched engine's step loop is alive (used by :mod:`.llama_engine`).

The engine tells its :class:`StepWatch` when a step begins and ends, and
what the step is doing meanwhile (``doing``: admitting, decoding a batch,
sampling under a grammar — and for which request). A step that has lasted
``stall_s`` makes the engine *stalled* (:meth:`StepWatch.stalled`): the
backend's ``unready_reason`` (``/readyz`` 503), a metric, and one ERROR line
saying what the step is doing and which requests the engine holds. Idle, or
with every sequence paused on a slow client, no step runs, and nothing is
stalled.

Any thread may ask (the readiness probe does); only the engine thread
begins and ends steps. A stall is logged at ERROR once, by whichever thread
asks first, and its end once, at WARNING, by the engine thread.
"""

from __future__ import annotations

import logging
import time

from .llama_sequences import Job

__all__ = ["StepWatch"]

log = logging.getLogger("wsserver.llama")

#: What an idle engine is doing: between steps.
IDLE = ("idle", "")


class StepWatch:
    """When the running step began, what it does, and whether it stalls."""

    def __init__(self, stall_s: float) -> None:
        #: After how long a step counts as stalled (0: never).
        self.stall_s = stall_s
        #: What the running step is doing now, and for which request ("": none).
        self.doing: tuple[str, str] = IDLE
        self._began: float | None = None
        self._reported = False

    def begin(self) -> None:
        """A step begins (on the engine thread)."""
        self._began = time.monotonic()

    def end(self) -> None:
        """The step has ended (on the engine thread): a stall it was is over."""
        began = self._began
        if self._reported and began is not None:
            log.warning(
                "the llama engine finished a step again, after %.1f s", time.monotonic() - began
            )
            self._reported = False
        self._began = None
        self.doing = IDLE

    def seconds(self) -> float:
        """How long the running step has lasted so far (0: between steps)."""
        began = self._began
        return 0.0 if began is None else max(0.0, time.monotonic() - began)

    def stalled(self, jobs: list[Job]) -> str | None:
        """Why the engine counts as stalled — a step has run for ``stall_s``
        or more — or None; ``jobs`` are the requests it runs. The first time
        in a stall it is logged at ERROR with what the engine is doing."""
        seconds = self.seconds()
        if self.stall_s <= 0 or seconds < self.stall_s:
            return None
        reason = (
            f"the llama engine has not finished a step for {seconds:.1f} s "
            f"({len(jobs)} request(s) running)"
        )
        if not self._reported:
            self._reported = True
            log.error(
                "%s: it is %s; requests: %s",
                reason,
                self.describe(),
                describe_jobs(jobs),
                extra={"stalled_s": round(seconds, 1)},
            )
        return reason

    def describe(self) -> str:
        """What the step is doing, for a log line."""
        phase, request_id = self.doing
        return f"{phase} (request {request_id})" if request_id else phase


def describe_jobs(jobs: list[Job]) -> str:
    """The first requests of ``jobs`` and where each is, for a log line."""
    parts = []
    for job in list(jobs)[:16]:
        state = "prompt" if job.fed < len(job.prompt) else "decoding"
        if job.grammar is not None:
            state += ", grammar"
        if job.waiting_room:
            state += ", paused on its client"
        parts.append(f"{job.request.id} ({state}, {job.produced} tokens)")
    return ", ".join(parts) or "none"

"""The server's pulls: one download per reference, shared by everyone who waits for it.

Theory of operation
-------------------
A pull is a blocking download (:meth:`wsserver.pull.hub.Hub.pull`) that may
last an hour; the loop only hears about it. :class:`Pulls` keeps one *job*
per reference (its canonical text): a daemon thread running the download,
the latest :class:`~wsserver.pull.progress.Progress` (with its rate and time
left; told to the subscribers at once when its status or file changes, else
at most once per ``interval`` — and the latest one always, ``interval`` after
the one before, even if the download then pauses), and the
:class:`Subscription` of each party waiting for it — a client's ``pull``
request, a configured model's load. A second pull of the same reference
joins the job: one download, its progress told to both.

**Leaving is not cancelling the download for the others.** A subscriber
that goes (a cancelled ``pull``, a disconnected client) only stops hearing;
the job is cancelled when its *last* subscriber leaves — unless it is
*kept*: a download started for a configured model (``hf:`` in the
configuration) runs to its end whatever happens to the requests that wait for
the model, so that a cancelled request never wastes what was fetched. A
cancelled job's thread stops within a chunk and keeps its partial file for a
later resume; the registry forgets the job at once, so a new pull of the
reference starts a new job, which waits at the blob's lock for the old thread
to let go and then resumes from the partial file.

Threads are daemons: a download stuck in a read (a silent network) must not
hold up the server's exit, and what it wrote is resumable anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable

from ..errors import PullError
from ..pull.hub import Hub, PullCancelled, Pulled
from ..pull.progress import Progress, RateMeter, Throttle
from ..pull.reference import Reference

__all__ = ["Pulls", "Subscription"]

log = logging.getLogger("wsserver.pull")

ProgressCallback = Callable[[Progress], None]


class Subscription:
    """One party waiting for a pull: its progress, its result, and its way out."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        #: Called on the loop with each progress report the job lets through.
        self.on_progress: ProgressCallback | None = None
        self._left = False

    @property
    def progress(self) -> Progress:
        return self._job.progress

    @property
    def reference(self) -> Reference:
        return self._job.reference

    async def wait(self) -> Pulled:
        """The pull's result; raises :class:`~wsserver.errors.PullError`, or
        :class:`PullCancelled` if the job was cancelled. Cancelling the wait
        does not leave (call :meth:`leave`)."""
        return await asyncio.shield(self._job.future)

    def leave(self) -> None:
        """This party goes; the last one to go cancels the download (unless kept)."""
        if not self._left:
            self._left = True
            self._job.leave(self)


class _Job:
    def __init__(self, owner: Pulls, reference: Reference, number: int) -> None:
        self.owner = owner
        self.reference = reference
        self.keep = False
        self.cancel = threading.Event()
        self.progress = Progress("resolving")
        self.subscribers: set[Subscription] = set()
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Pulled] = self.loop.create_future()
        # Nobody may be waiting when it fails: its exception must not be "never retrieved".
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.thread = threading.Thread(
            target=self._run, name=f"wsserver-pull-{number}", daemon=True
        )
        self._meter = RateMeter()
        self._throttle = Throttle(owner.interval)
        self._told: Progress | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _run(self) -> None:
        def report(progress: Progress) -> None:
            # A report per chunk written (a megabyte): few enough for the loop.
            self._call(self._update, progress)

        try:
            pulled = self.owner.hub.pull(self.reference, report=report, cancel=self.cancel)
        except BaseException as exc:  # PullError, PullCancelled, or a bug: the waiters hear it
            self._call(self._finish, None, exc)
        else:
            self._call(self._finish, pulled, None)

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            self.loop.call_soon_threadsafe(callback, *args)

    def _update(self, progress: Progress) -> None:
        now = self.loop.time()
        self.progress = self._meter.with_rate(progress, now)
        if self._throttle.admit(self.progress, now):
            self._tell()
        elif self._timer is None:
            # The latest report is told one interval after the one before, even
            # if no other comes (the download paused, or this was its last).
            self._timer = self.loop.call_later(self.owner.interval, self._tell_latest)

    def _tell_latest(self) -> None:
        self._timer = None
        if self.progress is not self._told and not self.future.done():
            self._throttle.admit(self.progress, self.loop.time())
            self._tell()

    def _tell(self) -> None:
        self._told = self.progress
        for subscriber in list(self.subscribers):
            if subscriber.on_progress is not None:
                subscriber.on_progress(self.progress)

    def _finish(self, pulled: Pulled | None, error: BaseException | None) -> None:
        self.owner._forget(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.future.done():
            return
        if error is None:
            assert pulled is not None
            self.future.set_result(pulled)
        elif isinstance(error, PullError | PullCancelled):
            self.future.set_exception(error)
        else:
            log.error("pull of %s failed: %r", self.reference.text, error)
            self.future.set_exception(PullError("hub_error", f"the pull failed: {error}"))

    def leave(self, subscriber: Subscription) -> None:
        self.subscribers.discard(subscriber)
        if not self.subscribers and not self.keep and not self.future.done():
            log.info("pull of %s: nobody waits for it any more; stopping", self.reference.text)
            self.cancel.set()
            self.owner._forget(self)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.future.set_exception(PullCancelled())


class Pulls:
    """Every pull of this server in progress (see the module docstring)."""

    def __init__(self, hub: Hub, *, interval: float = 0.5) -> None:
        self.hub = hub
        #: Seconds between two progress reports of a job (a new status or file
        #: is reported at once).
        self.interval = interval
        self._jobs: dict[str, _Job] = {}
        self._numbers = itertools.count(1)

    def __len__(self) -> int:
        return len(self._jobs)

    def start(self, reference: Reference, *, keep: bool = False) -> Subscription:
        """Join the download of ``reference``, starting it if none runs.

        ``keep``: this party's download runs to its end even if every party
        leaves (a configured model's load)."""
        job = self._jobs.get(reference.text)
        if job is None:
            job = _Job(self, reference, next(self._numbers))
            self._jobs[reference.text] = job
            log.info("pulling %s", reference.text)
            job.thread.start()
        job.keep = job.keep or keep
        subscription = Subscription(job)
        job.subscribers.add(subscription)
        return subscription

    def _forget(self, job: _Job) -> None:
        if self._jobs.get(job.reference.text) is job:
            del self._jobs[job.reference.text]

    def close(self) -> None:
        """At shutdown: every download stops (its partial file stays for a resume)."""
        for job in list(self._jobs.values()):
            job.cancel.set()
            if job._timer is not None:
                job._timer.cancel()
            if not job.future.done():
                job.future.set_exception(PullCancelled())
        self._jobs.clear()

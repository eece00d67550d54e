"""How far a pull is, and how to show it (sans-I/O).

The download (:mod:`wsserver.pull.hub`) reports a :class:`Progress` for the
whole pull — every file of it, bytes already in place included — each time
bytes are written, many times a second. Its readers want far fewer:

* :class:`Throttle` lets through a change of status or file at once and
  otherwise one report per interval (the server's progress frames, the
  ``queued`` frames of requests waiting for a model that downloads);
* :class:`RateMeter` turns the reports into a rate over the last seconds and
  a time left (a rate over the whole pull would hide a stall);
* :func:`bar_line` and :class:`PlainLines` render it for a terminal (one
  line redrawn in place: a bar, the size, the rate, the time left) and for a
  log or a pipe (a line per status change and per tenth of the download).

Nothing here reads a clock: every method takes ``now`` (monotonic seconds).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Final, Literal

__all__ = [
    "PULL_STATUSES",
    "PlainLines",
    "Progress",
    "PullStatus",
    "RateMeter",
    "Throttle",
    "bar_line",
    "human_bytes",
    "human_duration",
]

#: ``resolving``: asking the Hub which files; ``checking``: hashing what is
#: already on disk (a cached file, or the part of one an earlier pull left);
#: ``downloading``; ``verifying``: the last hash check of a file; ``done``.
PullStatus = Literal["resolving", "checking", "downloading", "verifying", "done"]
PULL_STATUSES: Final = ("resolving", "checking", "downloading", "verifying", "done")


@dataclass(frozen=True, slots=True)
class Progress:
    """One pull's state: bytes of the whole pull, every file counted."""

    status: PullStatus
    #: Bytes in place: cached, resumed or downloaded.
    completed: int = 0
    #: Bytes of every file of the pull (0 until the Hub has said).
    total: int = 0
    #: The file being worked on (its path in the repository).
    file: str | None = None
    #: Bytes per second over the last few seconds (``None``: not downloading).
    rate: float | None = None
    #: Seconds left at that rate (``None``: unknown).
    eta_s: float | None = None

    @property
    def fraction(self) -> float:
        return min(1.0, self.completed / self.total) if self.total > 0 else 0.0


class RateMeter:
    """Bytes per second over the last ``window`` seconds of reports."""

    def __init__(self, window: float = 5.0) -> None:
        self._window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, completed: int) -> None:
        samples = self._samples
        if samples and completed < samples[-1][1]:
            samples.clear()  # a file started again from its beginning
        samples.append((now, completed))
        while len(samples) > 2 and now - samples[1][0] >= self._window:
            samples.popleft()

    def rate(self) -> float | None:
        samples = self._samples
        if len(samples) < 2:
            return None
        (t0, b0), (t1, b1) = samples[0], samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else None

    def with_rate(self, progress: Progress, now: float) -> Progress:
        """``progress`` with its rate and time left, once it has been added."""
        if progress.status != "downloading":
            return replace(progress, rate=None, eta_s=None)
        self.add(now, progress.completed)
        rate = self.rate()
        eta = None
        if rate and rate > 0 and progress.total:
            eta = max(0.0, (progress.total - progress.completed) / rate)
        return replace(progress, rate=rate, eta_s=eta)


class Throttle:
    """Which reports to pass on: a new status or file at once, else one per ``interval``."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last: Progress | None = None
        self._at = 0.0

    def admit(self, progress: Progress, now: float) -> bool:
        last = self._last
        if (
            last is None
            or progress.status != last.status
            or progress.file != last.file
            or progress.total != last.total
            or now - self._at >= self._interval
        ):
            self._last, self._at = progress, now
            return True
        return False


_UNITS: Final = ("B", "kB", "MB", "GB", "TB")


def human_bytes(count: float) -> str:
    """``1234567`` → ``1.2 MB`` (decimal units, as download tools show them)."""
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """``130`` → ``2m10s``; ``4000`` → ``1h06m``."""
    whole = int(seconds + 0.5)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _figures(progress: Progress) -> str:
    parts = []
    if progress.total:
        parts.append(f"{human_bytes(progress.completed)} / {human_bytes(progress.total)}")
    if progress.rate is not None:
        parts.append(f"{human_bytes(progress.rate)}/s")
    if progress.eta_s is not None:
        parts.append(f"{human_duration(progress.eta_s)} left")
    return ", ".join(parts)


def bar_line(progress: Progress, width: int = 80) -> str:
    """One terminal line for ``progress``: what, a bar, the percentage, size, rate, time left."""
    name = progress.file.rpartition("/")[2] if progress.file else ""
    if len(name) > 32:
        name = "…" + name[-31:]
    figures = _figures(progress)
    if progress.status != "downloading" or not progress.total:
        return f"{progress.status} {name}  {figures}".rstrip()[:width]
    head = f"{name} "
    tail = f" {progress.fraction * 100:3.0f}%  {figures}"
    room = max(10, width - len(head) - len(tail) - 2)
    filled = int(room * progress.fraction)
    return (head + "[" + "#" * filled + "." * (room - filled) + "]" + tail)[:width]


class PlainLines:
    """Lines for a log or a pipe: one per status or file change, one per tenth
    of the download, and at most one per ``min_interval`` in between."""

    def __init__(self, min_interval: float = 30.0) -> None:
        self._interval = min_interval
        self._last: Progress | None = None
        self._tenth = -1
        self._at = 0.0

    def lines(self, progress: Progress, now: float) -> list[str]:
        last = self._last
        tenth = int(progress.fraction * 10)
        due = (
            last is None
            or progress.status != last.status
            or progress.file != last.file
            or (progress.status == "downloading" and tenth != self._tenth)
            or now - self._at >= self._interval
        )
        if not due:
            return []
        self._last, self._tenth, self._at = progress, tenth, now
        what = progress.status + (f" {progress.file}" if progress.file else "")
        figures = _figures(progress)
        if progress.status == "downloading" and progress.total:
            figures = f"{progress.fraction * 100:.0f}%, {figures}"
        return [f"{what}: {figures}" if figures else what]

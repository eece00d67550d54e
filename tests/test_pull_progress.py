"""Progress of a pull: rate, time left, throttling, terminal and log lines (sans-I/O)."""

from __future__ import annotations

from wsserver.pull.progress import (
    PlainLines,
    Progress,
    RateMeter,
    Throttle,
    bar_line,
    human_bytes,
    human_duration,
)

MB = 1_000_000


def test_the_rate_is_over_the_last_seconds_and_gives_the_time_left() -> None:
    meter = RateMeter(window=5.0)
    progress = Progress("downloading", 0, 100 * MB, "m.gguf")
    assert meter.with_rate(progress, 0.0).rate is None  # one sample: no rate yet
    for second in range(1, 11):
        shown = meter.with_rate(
            Progress("downloading", second * 2 * MB, 100 * MB, "m.gguf"), second
        )
    assert shown.rate == 2 * MB
    assert shown.eta_s == 40.0  # 80 MB left at 2 MB/s
    # A stall shows in the rate within the window (a whole-pull average would hide it).
    for second in range(11, 15):
        shown = meter.with_rate(Progress("downloading", 20 * MB, 100 * MB, "m.gguf"), second)
    assert shown.rate is not None and shown.rate < 1 * MB
    assert meter.with_rate(Progress("verifying", 100 * MB, 100 * MB), 20).rate is None


def test_a_file_started_over_resets_the_rate() -> None:
    meter = RateMeter()
    meter.add(0, 50 * MB)
    meter.add(1, 60 * MB)
    meter.add(2, 0)
    assert meter.rate() is None


def test_the_throttle_passes_changes_at_once_and_the_rest_once_per_interval() -> None:
    throttle = Throttle(0.5)
    assert throttle.admit(Progress("resolving"), 0.0)
    assert throttle.admit(Progress("downloading", 1, 10, "a"), 0.1)  # a new status
    assert not throttle.admit(Progress("downloading", 2, 10, "a"), 0.2)
    assert not throttle.admit(Progress("downloading", 3, 10, "a"), 0.59)
    assert throttle.admit(Progress("downloading", 4, 10, "a"), 0.6)
    assert throttle.admit(Progress("downloading", 5, 10, "b"), 0.61)  # a new file
    assert throttle.admit(Progress("done", 10, 10), 0.62)


def test_a_terminal_line_has_a_bar_size_rate_and_time_left() -> None:
    line = bar_line(
        Progress("downloading", 1_200 * MB, 3_400 * MB, "q4/model-Q4_K_M.gguf", 12.3 * MB, 179),
        width=100,
    )
    assert line.startswith("model-Q4_K_M.gguf [")
    assert "35%" in line
    assert "1.2 GB / 3.4 GB" in line and "12.3 MB/s" in line and "2m59s left" in line
    assert len(line) <= 100
    assert bar_line(Progress("resolving")) == "resolving"
    assert len(bar_line(Progress("downloading", 1, 2, "x" * 200, 1.0, 1.0), width=60)) <= 60


def test_plain_lines_come_at_changes_and_tenths() -> None:
    lines = PlainLines(min_interval=30)
    out: list[str] = []
    out += lines.lines(Progress("resolving"), 0)
    for step in range(0, 101, 2):
        out += lines.lines(Progress("downloading", step * MB, 100 * MB, "m.gguf"), 1 + step / 100)
    out += lines.lines(Progress("done", 100 * MB, 100 * MB), 3)
    assert out[0] == "resolving"
    downloading = [line for line in out if line.startswith("downloading")]
    assert len(downloading) == 11  # 0 %, 10 %, … 100 %
    assert downloading[5].startswith("downloading m.gguf: 50%, 50.0 MB / 100.0 MB")
    assert out[-1] == "done: 100.0 MB / 100.0 MB"
    # Between tenths, a line at most every min_interval seconds.
    slow = PlainLines(min_interval=30)
    assert slow.lines(Progress("downloading", 1, 1000, "m"), 0)
    assert not slow.lines(Progress("downloading", 2, 1000, "m"), 29)
    assert slow.lines(Progress("downloading", 3, 1000, "m"), 30)


def test_human_units() -> None:
    assert human_bytes(999) == "999 B"
    assert human_bytes(1_234_567) == "1.2 MB"
    assert human_bytes(4.2e12) == "4.2 TB"
    assert human_duration(59.4) == "59s"
    assert human_duration(130) == "2m10s"
    assert human_duration(4000) == "1h06m"

"""``wsserver pull`` and ``wsserver models``: the operator's side of models by name.

``pull`` downloads on a worker thread while the main thread shows how far —
on a terminal one line redrawn in place (a bar, the size, the rate, the time
left), elsewhere a line per status change and per tenth — and keeps Ctrl-C:
the download stops within a chunk and keeps what it fetched, so running the
same command again resumes it. The pulled model's path goes to stdout (for
scripts: ``--model "$(wsserver pull org/repo)"``), everything else to stderr.

Exit status: 0 pulled; 1 the pull failed (the message names the wire code
and what to do); 2 a bad reference or configuration; 130 interrupted.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from typing import Any, TextIO

from ..config import Config
from ..errors import PullError
from .cache import cached_models, partials, remove, remove_partials, used_by
from .hub import Hub, HubSettings, PullCancelled, Pulled
from .progress import PlainLines, Progress, RateMeter, bar_line, human_bytes
from .reference import parse_reference

__all__ = ["models_command", "pull_command", "remove_partials_command"]

#: How often a terminal's line is redrawn.
_REDRAW_S = 0.1


def pull_command(reference: str, config: Config, *, out: TextIO, err: TextIO) -> int:
    try:
        ref = parse_reference(reference)
    except PullError as exc:
        print(f"wsserver pull: {exc.message}", file=err)
        return 2
    hub = Hub(HubSettings.from_config(config.models))
    cancel = threading.Event()
    latest: list[Progress] = [Progress("resolving")]
    #: Each phase's last report (a file's 100 %), kept when the next phase
    #: begins before the display woke up to see it: shown before the latest.
    ended: list[Progress] = []
    lock = threading.Lock()
    outcome: list[Pulled | BaseException] = []
    changed = threading.Event()

    def report(progress: Progress) -> None:
        with lock:
            last = latest[0]
            if (progress.status, progress.file) != (last.status, last.file):
                ended.append(last)
            latest[0] = progress
        changed.set()

    def shown() -> list[Progress]:
        with lock:
            reports = [*ended, latest[0]]
            ended.clear()
        return reports

    def run() -> None:
        try:
            outcome.append(hub.pull(ref, report=report, cancel=cancel))
        except BaseException as exc:
            outcome.append(exc)
        changed.set()

    worker = threading.Thread(target=run, name="wsserver-pull", daemon=True)
    terminal = err.isatty()
    show = _TerminalLine(err) if terminal else _LogLines(err)
    print(f"pulling {ref.text} from {hub.settings.endpoint}", file=err)
    worker.start()
    try:
        while worker.is_alive():
            changed.wait(_REDRAW_S)
            changed.clear()
            for progress in shown():
                show(progress, time.monotonic())
    except KeyboardInterrupt:
        cancel.set()
        show.finish()
        print(
            "wsserver pull: interrupted; what was downloaded is kept — run the same "
            "command again to resume",
            file=err,
        )
        worker.join(5.0)
        return 130
    worker.join()
    for progress in shown():
        show(progress, time.monotonic())
    show.finish()
    result = outcome[0]
    if isinstance(result, PullError):
        print(f"wsserver pull: {result.code}: {result.message}", file=err)
        return 1
    if isinstance(result, PullCancelled):
        return 130
    if isinstance(result, BaseException):
        raise result
    fetched = (
        f"downloaded {human_bytes(result.downloaded)}" if result.downloaded else "already cached"
    )
    print(f"{ref.text}: {fetched}, verified", file=err)
    if result.mmproj is not None:
        print(f"  multimodal projector: {result.mmproj}", file=err)
    print(f"  serve it: wsserver serve --model hf:{ref.text}", file=err)
    print(result.model_path, file=out)
    return 0


class _TerminalLine:
    """One line redrawn in place, with a rate over the last seconds."""

    def __init__(self, err: TextIO) -> None:
        self._err = err
        self._meter = RateMeter()
        self._drawn = False

    def __call__(self, progress: Progress, now: float) -> None:
        width = max(40, shutil.get_terminal_size((80, 24)).columns - 1)
        line = bar_line(self._meter.with_rate(progress, now), width)
        self._err.write("\r\x1b[2K" + line)
        self._err.flush()
        self._drawn = True

    def finish(self) -> None:
        if self._drawn:
            self._err.write("\n")
            self._err.flush()
            self._drawn = False


class _LogLines:
    """Plain lines for a log or a pipe."""

    def __init__(self, err: TextIO) -> None:
        self._err = err
        self._meter = RateMeter()
        self._lines = PlainLines()

    def __call__(self, progress: Progress, now: float) -> None:
        for line in self._lines.lines(self._meter.with_rate(progress, now), now):
            print(line, file=self._err, flush=True)

    def finish(self) -> None:
        pass


def models_command(
    config: Config,
    *,
    remove_ref: str | None,
    force: bool,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    hub = Hub(HubSettings.from_config(config.models))
    cache = hub.settings.cache()
    models = used_by(cached_models(cache), config, hub)
    if remove_ref is not None:
        return _remove(remove_ref, models, hub, force=force, out=out, err=err)
    left = partials(cache)
    if as_json:
        listing: list[dict[str, Any]] = [
            {
                "reference": m.reference,
                "repo": m.repo,
                "path": m.path,
                "quant": m.quant,
                "commit": m.commit,
                "refs": list(m.refs),
                "size": m.size,
                "files": [str(f) for f in m.files],
                "projector": m.projector,
                "used_by": list(m.used_by),
            }
            for m in models
        ]
        partial = [{"repo": p.repo, "file": str(p.path), "size": p.size} for p in left]
        json.dump({"cache": str(cache), "models": listing, "partial": partial}, out, indent=2)
        out.write("\n")
        return 0
    print(f"cache: {cache}", file=out)
    if not models and not left:
        print("no GGUF models cached (pull one: wsserver pull org/repo[:QUANT])", file=out)
        return 0
    rows = [("MODEL", "QUANT", "SIZE", "USED BY")]
    for m in models:
        name = m.reference + (f"  (+{len(m.files) - 1} parts)" if len(m.files) > 1 else "")
        if m.projector:
            name += "  [projector]"
        rows.append((name, m.quant or "-", human_bytes(m.size), ", ".join(m.used_by) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
            + "  "
            + row[3],
            file=out,
        )
    for p in left:
        print(
            f"partial download: {p.repo} ({human_bytes(p.size)} so far; pulling it again "
            f"resumes, wsserver models --remove-partial {p.repo} deletes it)",
            file=out,
        )
    return 0


def _remove(
    reference: str,
    models: list[Any],
    hub: Hub,
    *,
    force: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    try:
        ref = parse_reference(reference)
    except PullError as exc:
        print(f"wsserver models: {exc.message}", file=err)
        return 2
    try:
        plan = hub.resolve_cached(ref)
    except PullError:
        print(f"wsserver models: {ref.text} is not in the cache ({hub.settings.cache()})", file=err)
        return 1
    users = [
        who
        for m in models
        if m.repo == ref.repo and m.path in {f.path for f in plan.parts}
        for who in m.used_by
    ]
    if users and not force:
        print(
            f"wsserver models: {ref.text} is used by {', '.join(users)}; "
            "give --force to remove it anyway",
            file=err,
        )
        return 1
    for path in remove(ref, hub):
        print(f"removed {path}", file=out)
    return 0


def remove_partials_command(repo: str, config: Config, *, out: TextIO, err: TextIO) -> int:
    try:
        ref = parse_reference(repo)
    except PullError as exc:
        print(f"wsserver models: {exc.message}", file=err)
        return 2
    hub = Hub(HubSettings.from_config(config.models))
    for path in remove_partials(ref.repo, hub):
        print(f"removed {path}", file=out)
    return 0

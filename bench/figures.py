"""How a section writes its figures into docs/benchmarks.md: numbers, targets, plots."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

TIMES = "\u00d7"


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def target(
    name: str,
    value: float | None,
    met: Callable[[float], bool],
    form: str,
    *,
    missing: str = "-",
    **extra: Any,
) -> dict[str, Any]:
    """A target's line: its name, the measured value shown with ``form``
    (``missing`` if there is none), and whether ``met(value)`` holds."""
    return {
        "name": name,
        "value": value,
        **extra,
        "shown": missing if value is None else form.format(value),
        "met": None if value is None else bool(met(value)),
    }


def target_rows(targets: Iterable[dict[str, Any]], missed: str = "**no**") -> list[str]:
    """Rows of a ``| target | result | met |`` table."""
    marks = {None: "-", True: "yes", False: missed}
    return [f"| {t['name']} | {t.get('shown', '-')} | {marks[t.get('met')]} |" for t in targets]


def paragraphs(notes: Iterable[str]) -> list[str]:
    """Notes as Markdown paragraphs, each followed by a blank line."""
    return [line for note in notes for line in (note, "")]


def save_plot(fig: Any, plt: Any, out_dir: Path, name: str) -> list[str]:
    """Lay out, write and close one figure; the file names a section's plot() returns."""
    fig.tight_layout()
    path = out_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]


def row(result: dict[str, Any], contender: str, phase: str | None = None) -> dict[str, Any] | None:
    """A contender's row of a section's ``rows`` (of one ``phase``), or None."""
    for r in result.get("rows", []):
        if r.get("contender") == contender and (phase is None or r.get("phase") == phase):
            return dict(r)
    return None

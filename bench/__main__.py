"""``python -m bench``: run the benchmark sections and write the report.

    python -m bench [--quick] [--sections throughput cancel ceiling slow idle page adversaries openai
                    upstream batched resume structured responses models freeze
                    templates conversations embeddings speculation images]
                    [--out docs/benchmarks.md] [--model PATH] [--threads N] [--merge]
                    [--baseline REF] [--drop-hand-text]

Writes the Markdown report to ``--out``, the raw figures next to it (same
name, ``.json``) and the plots into ``bench/`` beside it, and prints the
summary table. Sections that cannot run here (no llama backend, no model) are
reported as skipped; a section that fails is reported as failed and the exit
status is 1. With ``--merge`` the sections measured replace theirs in the
existing JSON and the report keeps the others (and says when each was
measured); a section skipped or failed keeps its earlier figures.

The report is written from the JSON alone, so a line written into it by hand
would be lost by the next run: before measuring anything the harness renders
the JSON beside ``--out`` again and stops (exit status 2), naming the lines it
would lose, unless ``--drop-hand-text``. Text measured outside the harness
belongs in the JSON as a recorded section (``analysis.recorded``) or a
``--note``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from .analysis import BY_KEY, SECTIONS, summary
from .common import Skip, loadavg
from .lineup import LlamaLineup
from .options import Options
from .report import hand_text, measured, merge, write

ALIASES = {section.number: section.key for section in SECTIONS}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a fast smoke run: few repeats, short windows"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=list(BY_KEY),
        metavar="NAME",
        help=f"any of {', '.join(BY_KEY)} (or 1-{len(SECTIONS)}); default all",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("docs/benchmarks.md"), help="Markdown report path"
    )
    parser.add_argument(
        "--model", help="GGUF for sections 1-2 (default: the default model package)"
    )
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0 = all cores)")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument(
        "--repeats", type=int, help="repeats in sections 1, 2 and 8 (default: 10, 5-10, 8)"
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: rewrite the report and plots from the JSON next to --out",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other sections of the JSON next to --out; replace only those measured",
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="sections 1-2 and 12 also run wsserver as of this git ref (e.g. the commit before a "
        "change), side by side with the working tree",
    )
    parser.add_argument(
        "--note",
        action="append",
        default=[],
        metavar="TEXT",
        help="a paragraph to print under the summary (kept in the JSON; repeatable)",
    )
    parser.add_argument(
        "--drop-hand-text",
        action="store_true",
        help="write the report even if it loses lines written into it by hand",
    )
    return parser


def _sections(names: list[str]) -> list[str]:
    out = []
    for item in names:
        for name in item.split(","):
            name = ALIASES.get(name.strip(), name.strip())
            if name not in BY_KEY:
                raise SystemExit(f"unknown section {name!r}; choose from {', '.join(BY_KEY)}")
            if name not in out:
                out.append(name)
    return out


def _failed(exc: BaseException) -> dict[str, Any]:
    return {
        "status": "failed",
        "reason": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(),
    }


async def _section(opts: Options, key: str, *args: Any) -> dict[str, Any]:
    """One section's result: its own, or why it was skipped or failed."""
    try:
        result: dict[str, Any] = await BY_KEY[key].module.run(opts, *args)
    except Skip as exc:
        return {"status": "skipped", "reason": str(exc)}
    except Exception as exc:
        return _failed(exc)
    return result


async def run(opts: Options, sections: list[str]) -> dict[str, Any]:
    """The chosen sections: first those that take turns on the llama lineup,
    then those on the fake engine, then those that load a model of their own."""
    results: dict[str, Any] = {}
    lineup = [s.key for s in SECTIONS if s.runs_on == "lineup" and s.key in sections]
    if lineup:
        opts.log("sections 1-2: llama contenders")
        try:
            async with LlamaLineup(opts) as contenders:
                for key in lineup:
                    results[key] = await _section(opts, key, contenders)
        except Skip as exc:
            results.update({key: {"status": "skipped", "reason": str(exc)} for key in lineup})
        except Exception as exc:
            for key in lineup:
                results.setdefault(key, _failed(exc))
    for runs_on in ("fake", "llama"):
        for section in SECTIONS:
            if section.runs_on == runs_on and section.key in sections:
                opts.log(f"section {section.key}" + (f": {section.what}" if section.what else ""))
                results[section.key] = await _section(opts, section.key)
    for name, result in results.items():
        if result.get("status") == "failed":
            opts.log(f"section {name} FAILED: {result['reason']}\n{result.get('traceback', '')}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    opts = Options(
        quick=args.quick,
        model=args.model,
        threads=args.threads,
        n_ctx=args.n_ctx,
        out=args.out,
        baseline=args.baseline,
        repeats=args.repeats,
    )
    sections = _sections(args.sections)
    lost = [] if args.drop_hand_text else hand_text(opts)
    if lost:
        shown = "\n".join(f"  {line[:160]}" for line in lost[:20])
        more = f"\n  … and {len(lost) - 20} more" if len(lost) > 20 else ""
        print(
            f"{opts.out} has {len(lost)} line(s) that its JSON does not give, which this run "
            f"would lose:\n{shown}{more}\nPut that text into {opts.out.with_suffix('.json').name} "
            "(a recorded section, or --note), or pass --drop-hand-text.",
            file=sys.stderr,
        )
        return 2
    if args.render_only:
        data = json.loads(opts.out.with_suffix(".json").read_text())
        data["meta"]["notes"] = [*data["meta"].get("notes", []), *args.note]
        paths = write(data["results"], data["meta"], opts)
        print(f"rewrote {paths['markdown']} and plots in {paths['plots']}/ from {paths['json']}")
        return 0
    started = datetime.datetime.now(datetime.UTC)
    load = loadavg()
    results = asyncio.run(run(opts, sections))
    failed = any(r.get("status") == "failed" for r in results.values())
    meta = {**measured(argv, opts, sections, started, load), "notes": list(args.note)}
    if args.merge and opts.out.with_suffix(".json").exists():
        old = json.loads(opts.out.with_suffix(".json").read_text())
        results, meta, kept = merge(results, meta, old)
        for key in kept:
            print(f"section {key} was not measured: its earlier figures are kept", file=sys.stderr)
    paths = write(results, meta, opts)
    print("\n".join(summary(results)))
    print(f"\nwrote {paths['markdown']}, {paths['json']} and plots in {paths['plots']}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

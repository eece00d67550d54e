"""``python -m bench``: run the benchmark sections and write the report.

    python -m bench [--quick] [--sections throughput cancel ceiling slow idle page adversaries openai
                    upstream batched resume structured responses models freeze]
                    [--out docs/benchmarks.md] [--model PATH] [--threads N] [--merge]
                    [--baseline REF]

Writes the Markdown report to ``--out``, the raw figures next to it (same
name, ``.json``) and the plots into ``bench/`` beside it, and prints the
summary table. Sections that cannot run here (no llama backend, no model) are
reported as skipped; a section that fails is reported as failed and the exit
status is 1. With ``--merge`` the sections measured replace theirs in the
existing JSON and the report keeps the others (and says when each was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import traceback
from pathlib import Path
from typing import Any

from . import (
    adversaries,
    batched,
    cancel,
    ceiling,
    freeze,
    idle,
    models,
    openai_sse,
    page,
    responses,
    resume,
    slow,
    structured,
    throughput,
    upstream,
)
from .common import Skip, git_commit, machine
from .lineup import LlamaLineup
from .options import Options
from .report import SECTIONS, command_line, write

ALIASES = {
    "1": "throughput",
    "2": "cancel",
    "3": "ceiling",
    "4": "slow",
    "5": "idle",
    "6": "page",
    "7": "adversaries",
    "8": "openai",
    "9": "upstream",
    "10": "batched",
    "11": "resume",
    "12": "structured",
    "13": "responses",
    "14": "models",
    "15": "freeze",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a fast smoke run: few repeats, short windows"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=list(SECTIONS),
        metavar="NAME",
        help=f"any of {', '.join(SECTIONS)} (or 1-6); default all",
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
    return parser


def _sections(names: list[str]) -> list[str]:
    out = []
    for item in names:
        for name in item.split(","):
            name = ALIASES.get(name.strip(), name.strip())
            if name not in SECTIONS:
                raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
            if name not in out:
                out.append(name)
    return out


def _failed(exc: BaseException) -> dict[str, Any]:
    return {
        "status": "failed",
        "reason": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(),
    }


async def run(opts: Options, sections: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    llama = [s for s in ("throughput", "cancel", "openai") if s in sections]
    if llama:
        opts.log("sections 1-2: llama contenders")
        try:
            async with LlamaLineup(opts) as session:
                if "throughput" in llama:
                    try:
                        results["throughput"] = await throughput.run(opts, session)
                    except Exception as exc:
                        results["throughput"] = _failed(exc)
                if "cancel" in llama:
                    step = (results.get("throughput") or {}).get("decode_step_ms")
                    try:
                        results["cancel"] = await cancel.run(opts, session, step)
                    except Exception as exc:
                        results["cancel"] = _failed(exc)
                if "openai" in llama:
                    try:
                        results["openai"] = await openai_sse.run(opts, session)
                    except Exception as exc:
                        results["openai"] = _failed(exc)
        except Skip as exc:
            for name in llama:
                results[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            for name in llama:
                results.setdefault(name, _failed(exc))
    fake_sections = (
        ("ceiling", ceiling),
        ("slow", slow),
        ("idle", idle),
        ("page", page),
        ("adversaries", adversaries),
        ("upstream", upstream),
        ("resume", resume),
    )
    for name, module in fake_sections:
        if name in sections:
            opts.log(f"section {name}")
            try:
                results[name] = await module.run(opts)
            except Exception as exc:
                results[name] = _failed(exc)
    # The llama sections, each of which may skip itself (Skip: a missing tool or model).
    llama_sections = (
        ("batched", batched, "the batched llama engine vs llama.cpp's tools"),
        ("structured", structured, "the sampler chain and JSON schemas (issue 22)"),
        ("responses", responses, "five turns four ways, and the Responses wire's overhead"),
        ("models", models, "TTFT loaded, on demand, after an eviction; memory (issue 23)"),
        ("freeze", freeze, "a long prompt beside three decoding streams (issue 28)"),
    )
    for name, module, what in llama_sections:
        if name not in sections:
            continue
        opts.log(f"section {name}: {what}")
        try:
            results[name] = await module.run(opts)
        except Skip as exc:
            results[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:
            results[name] = _failed(exc)
    for name, result in results.items():
        if result.get("status") == "failed":
            opts.log(f"section {name} FAILED: {result['reason']}\n{result.get('traceback', '')}")
    return results


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


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
    if args.render_only:
        import json

        data = json.loads(opts.out.with_suffix(".json").read_text())
        data["meta"]["notes"] = [*data["meta"].get("notes", []), *args.note]
        paths = write(data["results"], data["meta"], opts)
        print(f"rewrote {paths['markdown']} and plots in {paths['plots']}/ from {paths['json']}")
        return 0
    started = datetime.datetime.now(datetime.UTC)
    load_before = _loadavg()
    results = asyncio.run(run(opts, sections))
    meta = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "command": command_line(argv),
        "quick": opts.quick,
        "sections": sections,
        "duration_s": round((datetime.datetime.now(datetime.UTC) - started).total_seconds(), 1),
        "machine": machine(),
        # Other work on the machine during the run (1-, 5-, 15-minute load averages).
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "notes": list(args.note),
    }
    if args.merge and opts.out.with_suffix(".json").exists():
        import json

        old = json.loads(opts.out.with_suffix(".json").read_text())
        results = {**old["results"], **results}
        merged = {
            k: meta[k]
            for k in ("date", "commit", "command", "sections", "loadavg_before", "loadavg_after")
        }
        meta = {**old["meta"], "merged": [*old["meta"].get("merged", []), merged]}
    paths = write(results, meta, opts)
    from .analysis import summary

    print("\n".join(summary(results)))
    print(f"\nwrote {paths['markdown']}, {paths['json']} and plots in {paths['plots']}/")
    return 1 if any(r.get("status") == "failed" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

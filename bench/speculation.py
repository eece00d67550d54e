"""Section 19: speculative decoding beside llama-server's n-gram modes (issue 40): decode tok/s.

    python -m bench --sections speculation [--repeats 2] [--threads 2] [--merge]
    python -m bench.speculation [--rounds 2] [--model GGUF] [--threads 2] [--only NAME] [--quick]

Two greedy completions (``POST /v1/completions``, SSE, ``max_tokens`` 300) on
the default model: **copy** — a ~400-token code listing, then its first lines
again with a name changed, so the continuation repeats the listing (the
work of code edits, rewrites and agents quoting their inputs) — and
**prose**, a story's opening, where n-grams rarely repeat. Contenders, one
server at a time, alternating round by round (``--repeats``, default 2):
wsserver with ``speculative = "auto"`` (the default) and with it ``"off"``,
llama-server with no speculation and with ``--spec-type ngram-simple``,
``ngram-map-k`` and ``ngram-cache`` (its defaults otherwise;
``scripts/llama-tools`` builds it; without it its rows read "not measured").
The decode rate is the completion's tokens after the first over the time
from the first piece to the last (each server's own count of completion
tokens); medians. Draft tokens and those accepted: wsserver's
``wsserver_model_draft_tokens_total`` and ``…_accepted_total`` (``/metrics``)
before and after each request, llama-server's ``timings.draft_n`` and
``draft_n_accepted``. Each text is compared with wsserver's without drafts
(the first round's): greedy decoding with drafts should give the same text.

``--quick`` (a smoke run): 48 tokens, one round, wsserver only.

Run it on a quiet machine (nothing else running). ``python -m
bench.speculation`` runs this section alone and prints its part of
docs/benchmarks.md (``--json PATH`` keeps the result).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from .contenders import SseContender, llama_completion
from .figures import TIMES, fmt, target, target_rows
from .options import Options
from .servers import llama_model, llama_server, llama_wsserver, tools_for
from .timing import median, ratio

FUNCTION = '''def {name}(items, tax_rate, discount=None):
    """Return the total price of the items, with tax and an optional discount."""
    subtotal = 0.0
    for item in items:
        price = item["price"] * item.get("quantity", 1)
        if item.get("taxable", True):
            price = price * (1.0 + tax_rate)
        subtotal += price
    if discount is not None:
        if discount.get("kind") == "percent":
            subtotal = subtotal * (1.0 - discount["value"] / 100.0)
        elif discount.get("kind") == "fixed":
            subtotal = max(0.0, subtotal - discount["value"])
    return round(subtotal, 2)

'''
LISTING = "".join(FUNCTION.format(name=n) for n in ("order_total", "cart_total", "invoice_total"))
COPY = (
    "# prices.py\n\n"
    + LISTING
    + "\n# prices.py, with order_total renamed to compute_total\n\n"
    + FUNCTION.format(name="compute_total").split("\n")[0]
    + "\n"
)
PROSE = (
    "Once upon a time, in a village by the sea, there lived an old fisherman and his "
    "granddaughter. Every morning before dawn they"
)
PROMPTS = {"copy": COPY, "prose": PROSE}
MAX_TOKENS = 300
N_CTX = 4096

AUTO = 'wsserver, `speculative = "auto"`'
OFF = 'wsserver, `speculative = "off"`'
PEER = "llama-server, none"
#: name → wsserver's settings, or llama-server's extra arguments (a tuple).
CONTENDERS: dict[str, dict[str, Any] | tuple[str, ...]] = {
    AUTO: {"backend.llama.speculative": "auto"},
    OFF: {"backend.llama.speculative": "off"},
    PEER: (),
    "llama-server `--spec-type ngram-simple`": ("--spec-type", "ngram-simple"),
    "llama-server `--spec-type ngram-map-k`": ("--spec-type", "ngram-map-k"),
    "llama-server `--spec-type ngram-cache`": ("--spec-type", "ngram-cache"),
}
_DRAFTS = re.compile(r"^wsserver_model_draft_tokens(_accepted)?_total\{[^}]*\} (\S+)$", re.M)

#: One completion: (prompt, max_tokens) → tok/s, tokens, text, drafted, accepted.
Complete = Callable[[str, int], Awaitable[dict[str, Any]]]


def _rate(tokens: int, first: float | None, last: float | None) -> float | None:
    """Tokens after the first over the time from the first piece to the last
    (None: the answer came in one piece, too short to time)."""
    if first is None or last is None or tokens < 2 or last <= first:
        return None
    return (tokens - 1) / (last - first)


async def _drafts(session: aiohttp.ClientSession, base: str) -> tuple[int, int]:
    """wsserver's draft tokens and accepted ones since the model's load."""
    async with session.get(base + "/metrics") as response:
        text = await response.text()
    found = {bool(m.group(1)): int(float(m.group(2))) for m in _DRAFTS.finditer(text)}
    return found.get(False, 0), found.get(True, 0)


async def complete_ours(
    session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """One streamed ``/v1/completions`` on wsserver (``extra``: more of its body),
    its drafts from ``/metrics`` before and after."""
    drafted, accepted = await _drafts(session, base)
    port = urlsplit(base).port
    assert port is not None, base
    run = await SseContender("wsserver", port, extra).complete(prompt, max_tokens)
    after = await _drafts(session, base)
    return {
        "tok_s": _rate(run.tokens, run.first, run.last),
        "tokens": run.tokens,
        "text": run.text,
        "drafted": after[0] - drafted,
        "accepted": after[1] - accepted,
    }


async def complete_peer(port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed ``/completion`` of llama-server's own API (its timings count)."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False}
    stream = await llama_completion(port, body)
    timings = stream.final.get("timings") or {}
    drafted = timings.get("draft_n")
    return {
        "tok_s": _rate(stream.tokens, stream.first, stream.last),
        "tokens": stream.tokens,
        "text": stream.text,
        "drafted": drafted,
        "accepted": timings.get("draft_n_accepted") if drafted is not None else None,
    }


async def _round(complete: Complete, max_tokens: int) -> dict[str, dict[str, Any]]:
    await complete("Warm up:", 8)
    return {kind: await complete(prompt, max_tokens) for kind, prompt in PROMPTS.items()}


async def _contender(
    setup: dict[str, Any] | tuple[str, ...], model: str, threads: int, tools: Path | None, n: int
) -> dict[str, dict[str, Any]]:
    if isinstance(setup, dict):
        server = llama_wsserver(
            model, threads=threads, parallel=4, n_ctx=N_CTX, unpaced=True, **setup
        )
        async with server, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(600)) as session:
            base = server.http.rstrip("/")
            return await _round(lambda p, m: complete_ours(session, base, p, m), n)
    assert tools is not None
    args: tuple[str | int, ...] = ("-t", threads, "-c", 4 * N_CTX, *setup)
    async with llama_server(tools / "llama-server", model, *args) as peer:
        return await _round(lambda p, m: complete_peer(peer.port, p, m), n)


def _parted_at(text: str, base: str) -> int | None:
    """The first character where ``text`` leaves ``base`` (None: the same)."""
    if text == base:
        return None
    pairs = enumerate(zip(text, base, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(text), len(base)))


async def run(opts: Options, only: str = "") -> dict[str, Any]:
    model = llama_model(opts)
    threads = opts.n_threads
    tools = await tools_for(opts)
    rounds = 1 if opts.quick else (opts.repeats or 2)
    max_tokens = 48 if opts.quick else MAX_TOKENS
    chosen = {
        name: setup
        for name, setup in CONTENDERS.items()
        if (isinstance(setup, dict) or tools is not None) and (only in name or name in (OFF, PEER))
    }
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {name: [] for name in chosen}
    for turn in range(rounds):
        names = list(chosen) if turn % 2 == 0 else list(reversed(chosen))
        for name in names:
            opts.log(f"  speculation, round {turn + 1}/{rounds}: {name}")
            runs[name].append(await _contender(chosen[name], model, threads, tools, max_tokens))
    rows = []
    for name in CONTENDERS:
        # Each text against its own server's without drafts (llama-server's
        # without drafts against ours: do the two engines agree at all?).
        without = runs.get(PEER) if "--spec-type" in name else runs[OFF]
        for kind in PROMPTS:
            done = [r[kind] for r in runs.get(name, [])] if without else []
            row: dict[str, Any] = {"contender": name, "kind": kind, "measured": bool(done)}
            if done and without:
                first, base = done[0], without[0]
                row |= {
                    "tok_s": median(r["tok_s"] for r in done),
                    "rounds_tok_s": [r["tok_s"] for r in done],
                    "tokens": first["tokens"],
                    "drafted": first["drafted"],
                    "accepted": first["accepted"],
                    "without_drafts": PEER if "--spec-type" in name else OFF,
                    "same_text": first["text"] == base[kind]["text"],
                    "parted_at": _parted_at(first["text"], base[kind]["text"]),
                }
                if row["parted_at"] is not None:
                    # Where the text leaves the one without drafts: the two around it.
                    at = max(0, row["parted_at"] - 40)
                    row["parted"] = {
                        "with": first["text"][at : at + 80],
                        "without": base[kind]["text"][at : at + 80],
                    }
            rows.append(row)
    return {
        "status": "ok",
        "threads": threads,
        "model": Path(model).name,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "rows": rows,
    }


def _row(result: dict[str, Any], contender: str, kind: str) -> dict[str, Any]:
    found = [r for r in result["rows"] if r["contender"] == contender and r["kind"] == kind]
    return found[0] if found and found[0]["measured"] else {}


def _best_peer(result: dict[str, Any], kind: str) -> tuple[str, float | None]:
    """llama-server's fastest n-gram mode on ``kind`` (its name, its tok/s)."""
    modes = [
        (r["contender"], r["tok_s"])
        for r in result["rows"]
        if r["kind"] == kind and r["measured"] and "--spec-type" in r["contender"]
    ]
    return max(modes, key=lambda m: m[1], default=("", None))


def _vs_off(result: dict[str, Any], contender: str, kind: str) -> float | None:
    return ratio(_row(result, contender, kind).get("tok_s"), _row(result, OFF, kind).get("tok_s"))


def _same(result: dict[str, Any]) -> dict[str, bool | None]:
    return {kind: _row(result, AUTO, kind).get("same_text") for kind in PROMPTS}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 40's speculation targets, and greedy text that drafts do not change."""
    same = _same(result)
    measured = [v for v in same.values() if v is not None]
    bounds = (
        ("copy: >= 1.5{x} our own decode without speculation", _vs_off(result, AUTO, "copy"), 1.5),
        (
            "copy: >= 1.0{x} llama-server's best n-gram mode",
            ratio(_row(result, AUTO, "copy").get("tok_s"), _best_peer(result, "copy")[1]),
            1.0,
        ),
        (
            "prose: >= 0.97{x} our own decode without speculation",
            _vs_off(result, AUTO, "prose"),
            0.97,
        ),
    )
    return [
        *(
            target(
                "speculation, " + name.format(x=TIMES),
                value,
                lambda v, bound=bound: v >= bound,
                f"{{:,.2f}}{TIMES}",
                missing="not measured",
            )
            for name, value, bound in bounds
        ),
        {
            "name": "speculation: the greedy text with drafts equals the text without",
            "shown": ", ".join(f"{kind} {_yes(v)}" for kind, v in same.items()),
            "met": all(measured) if measured else None,
        },
    ]


def headlines(result: dict[str, Any]) -> list[str]:
    auto, off = _row(result, AUTO, "copy"), _row(result, OFF, "copy")
    name, best = _best_peer(result, "copy")
    mode = name.split("`")[1] if "`" in name else name
    peer = (
        f" (llama-server's best n-gram mode, `{mode}`: {fmt(best)} tok/s, "
        f"{fmt(ratio(auto.get('tok_s'), best), 2, TIMES)})"
        if best is not None
        else ""
    )
    same = ", ".join(f"{k} {_yes(v)}" for k, v in _same(result).items())
    return [
        f"| speculative decoding, n-gram drafts (section 19) | copy: `auto` "
        f"{fmt(auto.get('tok_s'))} tok/s against `off` {fmt(off.get('tok_s'))} "
        f"({fmt(_vs_off(result, AUTO, 'copy'), 2, TIMES)}){peer}; prose: "
        f"{fmt(_vs_off(result, AUTO, 'prose'), 2, TIMES)}; greedy text with drafts = without: "
        f"{same} |"
    ]


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def _drafts_cell(row: dict[str, Any]) -> str:
    if row.get("drafted") is None:
        return "-"
    return f"{row['drafted']:,} / {row['accepted']:,}"


def _same_cell(row: dict[str, Any]) -> str:
    if not row:
        return "-"
    if row["same_text"]:
        return "yes"
    return (
        f"**no** (from character {row['parted_at']})" if row["parted_at"] is not None else "**no**"
    )


def render(result: dict[str, Any]) -> str:
    lines = [
        f"`{result['model']}`, {result['threads']} thread(s), greedy, {result['max_tokens']} "
        "tokens, one server at a time, alternating round by round; medians of "
        f"{result['rounds']} round(s). Decode rate: tokens after the first over the time from "
        "the first piece to the last. Drafted / accepted: the first round's draft tokens and "
        "those accepted (-: the server did not report them). *= without*: the first round's "
        "text equals the one without drafts — wsserver's for wsserver and for llama-server "
        "without drafts, llama-server's own for its n-gram modes.",
        "",
        "| contender | copy tok/s | vs ours off | copy drafted / accepted | copy = without "
        "| prose tok/s | vs ours off | prose drafted / accepted | prose = without |",
        "|---|---:|---:|---:|:-:|---:|---:|---:|:-:|",
    ]
    for name in CONTENDERS:
        cells = []
        for kind in PROMPTS:
            row = _row(result, name, kind)
            cells += [
                fmt(row.get("tok_s")),
                fmt(_vs_off(result, name, kind), 2, TIMES),
                _drafts_cell(row),
                _same_cell(row),
            ]
        if any(c != "-" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"| {name} | not measured | | | | | | | |")
    lines += ["", "| target | result | met |", "|---|---|:-:|", *target_rows(targets(result))]
    return "\n".join(lines)


def notes(result: dict[str, Any]) -> list[str]:
    """Where the greedy text with drafts left the text without, when it did."""
    out = []
    for kind in PROMPTS:
        row = _row(result, AUTO, kind)
        if row.get("parted") is None:
            continue
        out.append(
            f"With drafts the greedy {kind} text left the text without them at character "
            f"{row['parted_at']:,} — with drafts `{json.dumps(row['parted']['with'])}`, "
            f"without `{json.dumps(row['parted']['without'])}` (from 40 characters before). "
            'docs/llama.md ("Batching and numerics") says when a greedy answer may part on '
            "quantized weights."
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.speculation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="GGUF (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--only",
        default="",
        help="only the contenders whose name has this (and the two without drafts)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (see above)")
    parser.add_argument("--json", type=Path, help="write the section's result here")
    args = parser.parse_args(argv)
    opts = Options(quick=args.quick, model=args.model, threads=args.threads, repeats=args.rounds)
    result = asyncio.run(run(opts, args.only))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(render(result))
    print("\n".join(["", *notes(result)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

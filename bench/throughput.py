"""Section 1 — throughput and time to first token on the default model.

Each repeat asks every contender for the same prompt (``max_tokens`` tokens,
temperature 0), rotating their order. Per request:

* **TTFT** — request sent → first non-empty text received;
* **decode tokens/s** — (tokens - 1) / (last text - first text): the rate the
  user watches text arrive, prompt processing excluded;
* **end-to-end tokens/s** — tokens / (last text - request sent).

Token counts come from wsserver's ``done.usage`` for the same prompt (greedy
decoding gives every contender the same tokens; the harness checks that the
texts are identical). Ratios are taken per repeat against the in-process run
of the same prompt, which sat next to it in time, and then the median of those.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from .contenders import InProcess, Run, WsContender
from .figures import fmt, row, save_plot, target
from .lineup import PROMPTS, LlamaLineup
from .options import Options
from .timing import median, pair_deltas, pair_ratios, ratio, side_by_side, summary


def contenders(lineup: LlamaLineup) -> dict[str, Any]:
    out: dict[str, Any] = {"in-process": lineup.inproc, "wsserver": lineup.ws}
    if lineup.peer is not None:
        out["llama_cpp.server"] = lineup.peer
    if lineup.ws_baseline is not None:
        out[lineup.ws_baseline.name] = lineup.ws_baseline
    return out


async def _rounds(
    opts: Options, entrants: dict[str, Any], repeats: int, max_tokens: int, **how: Any
) -> dict[str, list[Run]]:
    """A warm-up request each, then ``repeats`` prompts side by side (the
    ``shift``-th prompt first)."""
    for i, contender in enumerate(entrants.values()):
        await contender.complete(f"Warm-up {i}: hello", 8, -1)
    shift = how.pop("shift", 0)

    async def one(name: str, r: int) -> Run:
        opts.log(f"  throughput: {name}, repeat {r + 1}/{repeats}")
        prompt = PROMPTS[(r + shift) % len(PROMPTS)]
        run: Run = await entrants[name].complete(prompt, max_tokens, r)
        return run

    return await side_by_side(repeats, {n: functools.partial(one, n) for n in entrants}, **how)


def _paired(runs: list[Run], bases: list[Run], tokens: dict[int, int]) -> dict[str, Any]:
    """Decode ratios and TTFT differences per repeat (same prompt, adjacent in time), medians."""
    counts = [tokens.get(x.prompt_index, b.pieces) for x, b in zip(runs, bases, strict=True)]
    ratios = pair_ratios(
        [x.decode_tps(n) for x, n in zip(runs, counts, strict=True)],
        [b.decode_tps(n) for b, n in zip(bases, counts, strict=True)],
    )
    deltas = pair_deltas([x.ttft_ms for x in runs], [b.ttft_ms for b in bases])
    return {
        "decode_ratio_paired": median(ratios),
        "ttft_delta_ms_paired": median(deltas),
        "pairs": len(ratios),
    }


def _stats(runs: list[Run], tokens: dict[int, int]) -> dict[str, Any]:
    def count(x: Run) -> int:
        return tokens.get(x.prompt_index, x.pieces)

    return {
        "ttft_ms": summary(x.ttft_ms for x in runs),
        "decode_tps": summary(x.decode_tps(count(x)) for x in runs),
        # Tokens over the time from the request to the last text.
        "e2e_tps": summary(
            count(x) / (x.last - x.sent)
            for x in runs
            if count(x) and x.last is not None and x.last > x.sent
        ),
    }


async def run(opts: Options, lineup: LlamaLineup) -> dict[str, Any]:
    repeats = 2 if opts.quick else (opts.repeats or 10)
    max_tokens = 32 if opts.quick else 128
    entrants = contenders(lineup)
    opts.log(f"  throughput: warming up {len(entrants)} contenders …")
    runs = await _rounds(opts, entrants, repeats, max_tokens, order="rotate")

    # Tokens per prompt: wsserver's usage (same greedy tokens for everyone).
    tokens = {run.prompt_index: run.tokens for run in runs["wsserver"] if run.tokens}
    reference = {run.prompt_index: run.text for run in runs["in-process"]}
    rows = []
    for name, per in runs.items():
        paired = _paired(per, runs["in-process"], tokens)
        same = sum(1 for x in per if x.text == reference.get(x.prompt_index))
        rows.append(
            {
                "contender": name,
                **_stats(per, tokens),
                "decode_ratio_paired": paired["decode_ratio_paired"],
                "ttft_delta_ms_paired": paired["ttft_delta_ms_paired"],
                "texts_identical": f"{same}/{len(per)}",
                "pieces_per_request": summary(x.pieces for x in per),
            }
        )
    by = {row["contender"]: row for row in rows}
    base = by["in-process"]
    ws = by["wsserver"]
    for r in rows:
        r["decode_ratio_of_medians"] = ratio(
            r["decode_tps"]["median"], base["decode_tps"]["median"]
        )
        a, b = r["ttft_ms"]["median"], base["ttft_ms"]["median"]
        r["ttft_delta_ms_of_medians"] = a - b if a is not None and b is not None else None
    targets = [
        target(
            "wsserver decode throughput ≥ 0.98x in-process (paired median)",
            ws["decode_ratio_paired"],
            lambda v: v >= 0.98,
            "{:.3f}x",
        ),
        target(
            "wsserver TTFT ≤ in-process + 3 ms (median of paired differences)",
            ws["ttft_delta_ms_paired"],
            lambda v: v <= 3.0,
            "{:+.1f} ms",
        ),
    ]
    # Where wsserver's extra TTFT goes: inside the server (request read → first
    # delta handed to the socket, its own done.timings) or outside it (loopback
    # and the client's loop), each paired with the in-process run of the prompt.
    inside, outside = [], []
    for x, b in zip(runs["wsserver"], runs["in-process"], strict=True):
        if x.server_ttft_ms is not None and x.ttft_ms is not None and b.ttft_ms is not None:
            inside.append(x.server_ttft_ms - b.ttft_ms)
            outside.append(x.ttft_ms - x.server_ttft_ms)
    ws["server_ttft_ms"] = summary(x.server_ttft_ms for x in runs["wsserver"] if x.server_ttft_ms)
    ws["ttft_split_ms"] = {
        "server_minus_inprocess": median(inside),
        "client_minus_server": median(outside),
    }
    step = base["decode_tps"]["median"]
    lineup.decode_step_ms = 1000 / step if step else None
    versus = None
    if lineup.ws_baseline is not None:
        versus = _paired(runs["wsserver"], runs[lineup.ws_baseline.name], tokens)
        versus["ref"] = opts.baseline
    spare = None
    missed = targets[0]["met"] is False or targets[1]["met"] is False
    if missed and lineup.threads > 1 and not opts.quick:
        spare = await _spare_core(opts, lineup, repeats, max_tokens)
    for r in rows:
        opts.log(
            f"    {r['contender']:<18} TTFT {fmt(r['ttft_ms']['median'])} ms, "
            f"decode {fmt(r['decode_tps']['median'])} tok/s "
            f"(x{fmt(r['decode_ratio_paired'], 3)}), texts {r['texts_identical']}"
        )
    return {
        "status": "ok",
        "params": {
            "repeats": repeats,
            "max_tokens": max_tokens,
            "model": lineup.model,
            "threads": lineup.threads,
            "n_ctx": opts.n_ctx,
            "n_batch": opts.n_batch,
            "prompts": [PROMPTS[r % len(PROMPTS)] for r in range(repeats)],
        },
        "rows": rows,
        "targets": targets,
        "decode_step_ms": lineup.decode_step_ms,
        "spare_core": spare,
        "baseline": versus,
        "peer_error": lineup.peer_error,
        "raw": {
            name: [
                {
                    "prompt": x.prompt_index,
                    "ttft_ms": x.ttft_ms,
                    "last_s": x.since_sent(x.last),
                    "end_s": x.since_sent(x.end),
                    "pieces": x.pieces,
                    "tokens": tokens.get(x.prompt_index),
                }
                for x in per
            ]
            for name, per in runs.items()
        },
    }


async def _spare_core(
    opts: Options, lineup: LlamaLineup, repeats: int, max_tokens: int
) -> dict[str, Any]:
    """Diagnostic: in-process and wsserver again, both with one llama.cpp thread
    fewer than cores, so that the server's event loop and the client always
    find a free core. Paired as in the main table."""
    threads = lineup.threads - 1
    opts.log(f"  throughput: a target missed; diagnostic pair with {threads} llama thread(s) …")
    kw: dict[str, Any] = {"n_ctx": opts.n_ctx, "n_batch": opts.n_batch, "threads": threads}
    inproc = InProcess(lineup.model, **kw)
    ws = await WsContender(lineup.model, **kw, name=f"wsserver-{threads}t").start()
    try:
        pair = {"in-process": inproc, "wsserver": ws}
        runs = await _rounds(opts, pair, repeats, max_tokens, order="flip", shift=3)
    finally:
        await ws.stop()
        inproc.close()
    tokens = {x.prompt_index: x.tokens for x in runs["wsserver"] if x.tokens}
    paired = _paired(runs["wsserver"], runs["in-process"], tokens)
    out = {
        "threads": threads,
        "ttft_ms": {n: _stats(v, tokens)["ttft_ms"] for n, v in runs.items()},
        "decode_tps": {n: _stats(v, tokens)["decode_tps"] for n, v in runs.items()},
        "ttft_delta_ms_paired": paired["ttft_delta_ms_paired"],
        "decode_ratio_paired": paired["decode_ratio_paired"],
    }
    opts.log(
        f"    {threads} thread(s): wsserver TTFT {fmt(out['ttft_delta_ms_paired'])} ms from in-process, "
        f"decode x{fmt(out['decode_ratio_paired'], 3)}"
    )
    return out


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["targets"])


def headlines(tp: dict[str, Any]) -> list[str]:
    """The summary table's rows: decode throughput and TTFT against in-process."""
    base, ws, peer = row(tp, "in-process"), row(tp, "wsserver"), row(tp, "llama_cpp.server")
    assert base is not None and ws is not None
    return [
        f"| decode throughput, `{Path(tp['params']['model']).name}` | in-process {fmt(base['decode_tps']['median'])} tokens/s; "
        f"wsserver {fmt(ws['decode_tps']['median'])} (**{fmt(ws['decode_ratio_paired'], 3)}x**)"
        + (
            f"; llama_cpp.server {fmt(peer['decode_tps']['median'])} ({fmt(peer['decode_ratio_paired'], 3)}x)"
            if peer
            else ""
        )
        + " |",
        f"| time to first token (median) | in-process {fmt(base['ttft_ms']['median'])} ms; "
        f"wsserver {fmt(ws['ttft_ms']['median'])} ms (**{ws['ttft_delta_ms_paired']:+.1f} ms**)"
        + (f"; llama_cpp.server {fmt(peer['ttft_ms']['median'])} ms" if peer else "")
        + " |",
    ]


def render(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        f"Model `{p['model'].rsplit('/', 1)[-1]}`, n_ctx {p['n_ctx']}, n_batch {p['n_batch']}, "
        f"{p['threads']} threads for every contender; {p['repeats']} prompts x {p['max_tokens']} tokens, "
        "temperature 0, contenders' order rotated each repeat. Ratios and TTFT differences are per repeat "
        "against the in-process run of the same prompt, then the median.",
        "",
        "| contender | TTFT median / p99 (ms) | TTFT vs in-process | decode tokens/s median (min) "
        "| x in-process | end-to-end tokens/s | text = in-process |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        delta = r["ttft_delta_ms_paired"]
        lines.append(
            f"| {r['contender']} | {fmt(r['ttft_ms']['median'])} / {fmt(r['ttft_ms']['p99'])} "
            f"| {'-' if r['contender'] == 'in-process' else f'{delta:+.1f} ms' if delta is not None else '-'} "
            f"| {fmt(r['decode_tps']['median'])} ({fmt(r['decode_tps']['min'])}) "
            f"| {fmt(r['decode_ratio_paired'], 3)} | {fmt(r['e2e_tps']['median'])} | {r['texts_identical']} |"
        )
    ws = next((r for r in result["rows"] if r["contender"] == "wsserver"), None)
    split = (ws or {}).get("ttft_split_ms") or {}
    if split.get("server_minus_inprocess") is not None:
        lines += [
            "",
            "Where wsserver's TTFT goes (medians of per-repeat differences): its own timing "
            "(`done.timings.ttft_ms`, request frame read → first delta handed to the socket) is "
            f"{split['server_minus_inprocess']:+.1f} ms from the in-process TTFT of the same prompt; "
            f"the loopback and the client's loop add {split['client_minus_server']:.1f} ms on top.",
        ]
    spare = result.get("spare_core")
    if spare:
        lines += [
            "",
            f"Diagnostic pair, both with {spare['threads']} llama.cpp thread(s) (one core left free): "
            f"TTFT in-process {fmt(spare['ttft_ms']['in-process']['median'])} ms, wsserver "
            f"{fmt(spare['ttft_ms']['wsserver']['median'])} ms (paired difference "
            f"{spare['ttft_delta_ms_paired']:+.1f} ms); decode in-process "
            f"{fmt(spare['decode_tps']['in-process']['median'])}, wsserver "
            f"{fmt(spare['decode_tps']['wsserver']['median'])} tokens/s "
            f"(x{fmt(spare['decode_ratio_paired'], 3)}).",
        ]
    if result.get("peer_error"):
        lines += ["", f"llama_cpp.server could not be measured: {result['peer_error']}"]
    return "\n".join(lines)


def plot(result: dict[str, Any], plt: Any, out_dir: Any) -> list[str]:
    rows = result["rows"]
    raw = result.get("raw", {})
    names = [r["contender"] for r in rows]
    colors = ["#777", "#2a7", "#c63", "#27a"][: len(rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in (
        (axes[0], "decode_tps", "decode tokens/s (bar = median, dots = repeats)"),
        (axes[1], "ttft_ms", "time to first token, ms (bar = median, dots = repeats)"),
    ):
        medians = [r[key]["median"] or 0 for r in rows]
        ax.bar(names, medians, color=colors, alpha=0.8)
        for x, name in enumerate(names):
            if key == "ttft_ms":
                values = [v["ttft_ms"] for v in raw.get(name, []) if v.get("ttft_ms") is not None]
            else:
                values = [
                    (v["tokens"] - 1) / (v["last_s"] - v["ttft_ms"] / 1000)
                    for v in raw.get(name, [])
                    if v.get("tokens")
                    and v.get("ttft_ms") is not None
                    and v.get("last_s")
                    and v["last_s"] > v["ttft_ms"] / 1000
                ]
            ax.scatter([x] * len(values), values, color="black", s=8, zorder=3)
        top = max(medians) if medians else 1
        ax.set_ylim(0, top * (1.6 if key == "decode_tps" else 3.0))
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        for x, v in enumerate(medians):
            ax.annotate(f"{v:,.1f}", (x, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(
        "Streaming the model: in-process vs wsserver vs llama_cpp.server (outliers clipped)"
    )
    return save_plot(fig, plt, out_dir, "throughput_ttft.png")


def notes(r: dict[str, Any]) -> list[str]:
    notes = []
    ws = row(r, "wsserver")
    by = {t["name"]: t for t in r.get("targets", [])}
    ttft = next((t for n, t in by.items() if "TTFT" in n), None)
    tput = next((t for n, t in by.items() if "throughput" in n), None)
    if ttft and ttft["met"] is False:
        assert ws is not None
        text = (
            f"**Missed: TTFT.** wsserver's first token arrives {ws['ttft_delta_ms_paired']:+.1f} ms after "
            "in-process (target +3 ms)."
        )
        split = ws.get("ttft_split_ms") or {}
        if split.get("server_minus_inprocess") is not None:
            text += (
                f" Of that, {split['server_minus_inprocess']:+.1f} ms is inside the server (its own "
                "`done.timings.ttft_ms` against in-process: reading the frame, the scheduler, starting "
                "the producer thread, tokenizing, and the token's trip through the channel to the "
                f"sender) and {split['client_minus_server']:.1f} ms outside it (the frames' trip over "
                "loopback and both event loops; in-process has neither)."
            )
        spare = r.get("spare_core")
        if (
            spare
            and spare.get("ttft_delta_ms_paired") is not None
            and (spare["ttft_delta_ms_paired"] < ws["ttft_delta_ms_paired"] - 1)
        ):
            threads = r["params"]["threads"]
            within = spare["ttft_delta_ms_paired"] <= 3
            base = row(r, "in-process")
            assert base is not None
            base_tps = base["decode_tps"]["median"] or 0
            spare_tps = spare["decode_tps"]["in-process"]["median"] or 0
            cost = (
                "this model decodes no slower with one thread fewer "
                f"({fmt(spare_tps)} vs {fmt(base_tps)} tokens/s in-process)"
                if spare_tps >= 0.97 * base_tps
                else f"at a cost in decode speed ({fmt(spare_tps)} vs {fmt(base_tps)} tokens/s in-process)"
            )
            text += (
                (" Cause: CPU contention." if within else " CPU contention explains part of it.")
                + f" llama.cpp runs {threads} threads, one per core; as soon as the first token is "
                "sampled they start on the next one, and the server's event loop (which sends the frame) "
                "and the client's loop (which reads it) wait for a core. With one llama.cpp thread "
                f"fewer for both in-process and wsserver ({spare['threads']}; a diagnostic pair, "
                f"{r['params']['repeats']} paired repeats) wsserver's TTFT is "
                f"{spare['ttft_delta_ms_paired']:+.1f} ms from in-process "
                f"({'within' if within else 'still outside'} the target), decode "
                f"x{fmt(spare['decode_ratio_paired'], 3)}; in-process TTFT itself moves from "
                f"{fmt(base['ttft_ms']['median'])} to {fmt(spare['ttft_ms']['in-process']['median'])} ms "
                "(prompt processing has fewer threads). **What would close it:** leave one core to the "
                "event loop on small machines (`backend.llama.n_threads` = cores - 1 by default when "
                f"cores are few; {cost}), or run the loop thread at a higher priority than llama.cpp's "
                "threads."
            )
        else:
            if spare and spare.get("ttft_delta_ms_paired") is not None:
                text += (
                    f" Leaving a core free did not narrow it in this run (with {spare['threads']} "
                    f"llama.cpp thread(s) for both: {spare['ttft_delta_ms_paired']:+.1f} ms), so CPU "
                    "contention is not the main cause here."
                )
            inside = split.get("server_minus_inprocess")
            outside = split.get("client_minus_server")
            if inside is not None and outside is not None and outside > inside:
                fix = (
                    "the larger share is outside the server: the bundled client parses and validates "
                    "every frame into dataclasses on its event loop before the caller sees text; a "
                    "lighter first-frame path in the client (or a browser client) would recover it"
                )
            else:
                fix = (
                    "the larger share is inside the server: per request it starts a producer thread "
                    "and hands every token through a janus queue to the loop; a producer thread kept "
                    "per slot, and waking the sender directly for the first token, would recover it"
                )
            text += (
                " **What would close it:** the gap is a few milliseconds of per-request hand-offs; "
                f"{fix}."
            )
        notes.append(text)
    if tput and tput["met"] is False:
        assert ws is not None
        text = (
            f"**Missed: throughput.** wsserver decodes at {fmt(ws['decode_ratio_paired'], 3)}x in-process "
            f"(target 0.98x). llama.cpp runs {r['params']['threads']} threads, one per core, and shares "
            "them with the server's event loop, the producer thread's Python work per token (text "
            "assembly, the queue put) and the client; each of those preempts a compute thread, and "
            "llama.cpp's threads wait for each other at every step."
        )
        spare = r.get("spare_core")
        if spare and spare.get("decode_ratio_paired") is not None:
            text += (
                f" With one llama.cpp thread fewer for both contenders ({spare['threads']}), wsserver "
                f"decodes at x{fmt(spare['decode_ratio_paired'], 3)} of in-process."
            )
        text += (
            " What would close it: leave a core free for the loop on small machines (`n_threads` = "
            "cores - 1), and keep per-token Python work on the producer thread minimal."
        )
        notes.append(text)
    versus = r.get("baseline")
    if versus and versus.get("decode_ratio_paired") is not None:
        notes.append(
            f"**Against the baseline** `wsserver@{versus['ref']}` (the same harness running that "
            "commit's server side by side, paired per repeat over "
            f"{versus['pairs']} repeats): decode x{fmt(versus['decode_ratio_paired'], 3)}, TTFT "
            f"{versus['ttft_delta_ms_paired']:+.1f} ms."
        )
    peer = row(r, "llama_cpp.server")
    if (
        peer is not None
        and ws is not None
        and peer["decode_tps"]["median"]
        and ws["decode_tps"]["median"]
    ):
        notes.append(
            f"llama_cpp.server streams at {fmt(peer['decode_ratio_paired'], 3)}x in-process here; its TTFT "
            f"is {fmt(peer['ttft_ms']['median'])} ms against wsserver's {fmt(ws['ttft_ms']['median'])} ms."
        )
    return notes

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

import statistics
from typing import Any

from .common import fmt, summary
from .contenders import Run
from .lineup import PROMPTS, LlamaLineup
from .options import Options


async def _complete(contender: Any, prompt: str, max_tokens: int, index: int) -> Run:
    run: Run = await contender.complete(prompt, max_tokens, index)
    return run


def contenders(session: LlamaLineup) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("in-process", session.inproc), ("wsserver", session.ws)]
    if session.peer is not None:
        out.append(("llama_cpp.server", session.peer))
    if session.ws_nodelay is not None:
        out.append(("wsserver+nodelay", session.ws_nodelay))
    if session.ws_baseline is not None:
        out.append((session.ws_baseline.name, session.ws_baseline))
    return out


async def run(opts: Options, session: LlamaLineup) -> dict[str, Any]:
    repeats = 2 if opts.quick else (opts.repeats or 10)
    max_tokens = 32 if opts.quick else 128
    entrants = contenders(session)
    opts.log(f"  throughput: warming up {len(entrants)} contenders …")
    for i, (_, contender) in enumerate(entrants):
        await _complete(contender, f"Warm-up {i}: hello", 8, -1)
    runs: dict[str, list[Run]] = {name: [] for name, _ in entrants}
    for r in range(repeats):
        prompt = PROMPTS[r % len(PROMPTS)]
        order = entrants[r % len(entrants) :] + entrants[: r % len(entrants)]
        for name, contender in order:
            runs[name].append(await _complete(contender, prompt, max_tokens, r))
        opts.log(f"  throughput: repeat {r + 1}/{repeats} done")

    # Tokens per prompt: wsserver's usage (same greedy tokens for everyone).
    tokens = {run.prompt_index: run.tokens for run in runs["wsserver"] if run.tokens}
    reference = {run.prompt_index: run.text for run in runs["in-process"]}
    rows = []
    for name, _ in entrants:
        per = runs[name]
        ttft = [1000 * x.first for x in per if x.first is not None]
        decode = [
            v for x in per if (v := x.decode_tps(tokens.get(x.prompt_index, x.pieces))) is not None
        ]
        e2e = [v for x in per if (v := _e2e(x, tokens.get(x.prompt_index, x.pieces))) is not None]
        ratios, ttft_deltas = [], []
        for x, base in zip(per, runs["in-process"], strict=True):
            n = tokens.get(x.prompt_index, base.pieces)
            a, b = x.decode_tps(n), base.decode_tps(n)
            if a and b:
                ratios.append(a / b)
            if x.first is not None and base.first is not None:
                ttft_deltas.append(1000 * (x.first - base.first))
        same = sum(1 for x in per if x.text == reference.get(x.prompt_index))
        rows.append(
            {
                "contender": name,
                "ttft_ms": summary(ttft),
                "decode_tps": summary(decode),
                "e2e_tps": summary(e2e),
                "decode_ratio_paired": statistics.median(ratios) if ratios else None,
                "ttft_delta_ms_paired": statistics.median(ttft_deltas) if ttft_deltas else None,
                "texts_identical": f"{same}/{len(per)}",
                "pieces_per_request": summary(x.pieces for x in per),
            }
        )
    by = {row["contender"]: row for row in rows}
    base = by["in-process"]
    ws = by["wsserver"]
    for row in rows:
        row["decode_ratio_of_medians"] = _ratio(
            row["decode_tps"]["median"], base["decode_tps"]["median"]
        )
        row["ttft_delta_ms_of_medians"] = _diff(row["ttft_ms"]["median"], base["ttft_ms"]["median"])
    targets = [
        _target(
            "wsserver decode throughput ≥ 0.98x in-process (paired median)",
            ws["decode_ratio_paired"],
            lambda v: v >= 0.98,
            "{:.3f}x",
        ),
        _target(
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
        if x.server_ttft_ms is not None and x.first is not None and b.first is not None:
            inside.append(x.server_ttft_ms - 1000 * b.first)
            outside.append(1000 * x.first - x.server_ttft_ms)
    ws["server_ttft_ms"] = summary(x.server_ttft_ms for x in runs["wsserver"] if x.server_ttft_ms)
    ws["ttft_split_ms"] = {
        "server_minus_inprocess": statistics.median(inside) if inside else None,
        "client_minus_server": statistics.median(outside) if outside else None,
    }
    decode_step_ms = 1000 / base["decode_tps"]["median"] if base["decode_tps"]["median"] else None
    versus = None
    if session.ws_baseline is not None:
        versus = _versus(runs["wsserver"], runs[session.ws_baseline.name], tokens)
        versus["ref"] = session.opts.baseline
    spare = None
    missed = targets[0]["met"] is False or targets[1]["met"] is False
    if missed and session.threads > 1 and not opts.quick:
        spare = await _spare_core(opts, session, repeats, max_tokens)
    for row in rows:
        opts.log(
            f"    {row['contender']:<18} TTFT {fmt(row['ttft_ms']['median'])} ms, "
            f"decode {fmt(row['decode_tps']['median'])} tok/s "
            f"(x{fmt(row['decode_ratio_paired'], 3)}), texts {row['texts_identical']}"
        )
    return {
        "status": "ok",
        "params": {
            "repeats": repeats,
            "max_tokens": max_tokens,
            "model": session.model,
            "threads": session.threads,
            "n_ctx": opts.n_ctx,
            "n_batch": opts.n_batch,
            "prompts": [PROMPTS[r % len(PROMPTS)] for r in range(repeats)],
        },
        "rows": rows,
        "targets": targets,
        "decode_step_ms": decode_step_ms,
        "spare_core": spare,
        "baseline": versus,
        "peer_error": session.peer_error,
        "raw": {
            name: [
                {
                    "prompt": x.prompt_index,
                    "ttft_ms": 1000 * x.first if x.first else None,
                    "last_s": x.last,
                    "end_s": x.end,
                    "pieces": x.pieces,
                    "tokens": tokens.get(x.prompt_index),
                }
                for x in per
            ]
            for name, per in runs.items()
        },
    }


def _versus(now: list[Run], then: list[Run], tokens: dict[int, int]) -> dict[str, Any]:
    """The working tree against the baseline, paired per repeat (same prompt, adjacent in time)."""
    ratios, deltas = [], []
    for x, b in zip(now, then, strict=True):
        n = tokens.get(x.prompt_index, b.pieces)
        a, c = x.decode_tps(n), b.decode_tps(n)
        if a and c:
            ratios.append(a / c)
        if x.first is not None and b.first is not None:
            deltas.append(1000 * (x.first - b.first))
    return {
        "decode_ratio_paired": statistics.median(ratios) if ratios else None,
        "ttft_delta_ms_paired": statistics.median(deltas) if deltas else None,
        "pairs": len(ratios),
    }


async def _spare_core(
    opts: Options, session: LlamaLineup, repeats: int, max_tokens: int
) -> dict[str, Any]:
    """Diagnostic: in-process and wsserver again, both with one llama.cpp thread
    fewer than cores, so that the server's event loop and the client always
    find a free core. Paired as in the main table."""
    from .contenders import InProcess, WsContender

    threads = session.threads - 1
    opts.log(f"  throughput: a target missed; diagnostic pair with {threads} llama thread(s) …")
    kw: dict[str, Any] = {"n_ctx": opts.n_ctx, "n_batch": opts.n_batch, "threads": threads}
    inproc = InProcess(session.model, **kw)
    ws = await WsContender(session.model, **kw, name=f"wsserver-{threads}t").start()
    try:
        pair: list[tuple[str, Any]] = [("in-process", inproc), ("wsserver", ws)]
        for i, (_, contender) in enumerate(pair):
            await _complete(contender, f"Warm-up {i}: hello", 8, -1)
        runs: dict[str, list[Run]] = {"in-process": [], "wsserver": []}
        for r in range(repeats):
            prompt = PROMPTS[(r + 3) % len(PROMPTS)]
            for name, contender in pair if r % 2 == 0 else pair[::-1]:
                runs[name].append(await _complete(contender, prompt, max_tokens, r))
    finally:
        await ws.stop()
        inproc.close()
    deltas, ratios = [], []
    for a, b in zip(runs["wsserver"], runs["in-process"], strict=True):
        if a.first is not None and b.first is not None:
            deltas.append(1000 * (a.first - b.first))
        x, y = a.decode_tps(a.tokens), b.decode_tps(a.tokens)
        if x and y:
            ratios.append(x / y)
    out = {
        "threads": threads,
        "ttft_ms": {
            n: summary(1000 * x.first for x in v if x.first is not None) for n, v in runs.items()
        },
        "decode_tps": {
            n: summary(d for x in v if (d := x.decode_tps(runs["wsserver"][x.prompt_index].tokens)))
            for n, v in runs.items()
        },
        "ttft_delta_ms_paired": statistics.median(deltas) if deltas else None,
        "decode_ratio_paired": statistics.median(ratios) if ratios else None,
    }
    opts.log(
        f"    {threads} thread(s): wsserver TTFT {fmt(out['ttft_delta_ms_paired'])} ms from in-process, "
        f"decode x{fmt(out['decode_ratio_paired'], 3)}"
    )
    return out


def _e2e(run: Run, n: int | None) -> float | None:
    if not n or run.last is None or run.last <= 0:
        return None
    return n / run.last


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _target(name: str, value: float | None, ok: Any, form: str) -> dict[str, Any]:
    return {
        "name": name,
        "value": value,
        "shown": "-" if value is None else form.format(value),
        "met": None if value is None else bool(ok(value)),
    }


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
    fig.tight_layout()
    path = out_dir / "throughput_ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]

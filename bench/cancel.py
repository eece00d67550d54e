"""Section 2 — cancel latency, mid-decode and mid-prefill.

(a) **Mid-decode**: a long request streams for a while; after a random part
of one decode step the client cancels. Measured: cancel sent → ``done``
received (*ack*), and cancel sent → first text of the next, short request on
the same connection (*next first token*). Subtracting that short request's
TTFT on an idle model gives how long the cancelled generation still held the
model (*model busy after cancel*).

(b) **Mid-prefill**: the same with a ~3,000-token prompt, cancelled while
the model is still processing the prompt.

For ``llama_cpp.server``, which has no cancel message, cancel means closing
the stream (what a browser does on Stop): there is no ack, only the wait of
the next request. For in-process llama-cpp-python, cancel is closing the
generator between tokens; mid-prefill there is no way to interrupt the call.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

from .contenders import InProcess, SseContender, WsContender
from .figures import fmt, row, save_plot, target
from .lineup import NEXT_PROMPTS, PROMPTS, LlamaLineup, long_prompt
from .options import Options
from .timing import median, now, summary

NEXT_TOKENS = 8
WARM_TOKENS = 16
LONG_TOKENS = 1000
#: Quick mode runs on a tiny random-weight model whose garbled bytes make
#: llama-cpp-python's streaming slow down with length: keep requests short.
LONG_TOKENS_QUICK = 60


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


async def _read_for(texts: AsyncIterator[str | None], seconds: float) -> None:
    """Read a stream until ``seconds`` after its first text (None: no text yet)."""
    first = None
    async for text in texts:
        if text is not None and first is None:
            first = now()
        if first is not None and now() - first >= seconds:
            return


# ------------------------------------------------------------------ wsserver


async def _ws_cancel(ws: WsContender, stream: Any, nxt: str) -> dict[str, Any]:
    """Cancel ``stream``; then the next request on the same connection."""
    t0 = now()
    done = await ws.client.cancel(stream.id)
    ack = now() - t0
    following = ws.client.generate(prompt=nxt, max_tokens=NEXT_TOKENS, temperature=0)
    first = None
    async for _ in following:
        if first is None:
            first = now()
    return {
        "ack_ms": _ms(ack),
        "next_first_ms": _ms(None if first is None else first - t0),
        "reason": getattr(done, "reason", None),
    }


async def ws_mid_decode(
    ws: WsContender, prompt: str, nxt: str, stream_s: float, jitter_s: float, long_tokens: int
) -> dict[str, Any]:
    stream = ws.client.generate(prompt=prompt, max_tokens=long_tokens, temperature=0)
    await _read_for(stream, stream_s)
    await asyncio.sleep(jitter_s)  # land the cancel at a random point of a decode step
    return await _ws_cancel(ws, stream, nxt)


async def ws_mid_prefill(ws: WsContender, prompt: str, nxt: str, delay_s: float) -> dict[str, Any]:
    stream = ws.client.generate(prompt=prompt, max_tokens=NEXT_TOKENS, temperature=0)
    await stream.send()
    await asyncio.sleep(delay_s)  # the scenario: the user gives up this far into the prefill
    in_prefill = stream.started and not stream.deltas and stream.done is None
    return {**await _ws_cancel(ws, stream, nxt), "in_prefill": in_prefill}


# ------------------------------------------------------------------ peer: cancel = close


async def _texts(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str | None]:
    async for event in events:
        yield event["choices"][0].get("text") or None


async def peer_mid_decode(
    peer: SseContender, prompt: str, nxt: str, stream_s: float, jitter_s: float, long_tokens: int
) -> dict[str, Any]:
    stream = await peer.open(prompt, long_tokens)
    await _read_for(_texts(stream.events()), stream_s)
    await asyncio.sleep(jitter_s)
    t0 = now()
    stream.abort()
    first = await peer.first_text(nxt, NEXT_TOKENS, 120)
    return {"ack_ms": None, "next_first_ms": _ms(None if first is None else first - t0)}


async def peer_mid_prefill(
    peer: SseContender, prompt: str, nxt: str, delay_s: float
) -> dict[str, Any]:
    t0 = await peer.abandon(prompt, NEXT_TOKENS, delay_s)
    first = await peer.first_text(nxt, NEXT_TOKENS, 600)
    return {"ack_ms": None, "next_first_ms": _ms(None if first is None else first - t0)}


# ------------------------------------------------------------------ in-process: close the generator


def inproc_mid_decode(
    inproc: InProcess, prompt: str, nxt: str, stream_s: float, long_tokens: int
) -> dict[str, Any]:
    gen = inproc.completion_stream(prompt, long_tokens)
    first = None
    for chunk in gen:
        if chunk["choices"][0]["text"] and first is None:
            first = now()
        if first is not None and now() - first >= stream_s:
            break
    t0 = now()
    gen.close()
    ack = now() - t0
    run = inproc.complete_sync(nxt, NEXT_TOKENS)
    return {
        "ack_ms": _ms(ack),
        "next_first_ms": _ms(ack + run.first - run.sent) if run.first is not None else None,
    }


# ------------------------------------------------------------------ section


async def _bounded(awaitable: Any, seconds: float) -> dict[str, Any]:
    """One measurement, or a record that it did not finish in ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            return dict(await awaitable)
    except TimeoutError:
        return {"ack_ms": None, "next_first_ms": None, "error": f"no result within {seconds:g} s"}


def _reps(opts: Options) -> dict[str, dict[str, int]]:
    """Measurements per phase and contender."""
    if opts.quick:
        return {
            "decode": {"wsserver": 2, "llama_cpp.server": 1, "in-process": 1},
            "prefill": {"wsserver": 1, "llama_cpp.server": 1},
        }
    n = opts.repeats
    if n:
        half = max(1, n // 2)
        return {
            "decode": {"wsserver": n, "llama_cpp.server": half, "in-process": half},
            "prefill": {"wsserver": half, "llama_cpp.server": 1},
        }
    return {
        "decode": {"wsserver": 10, "llama_cpp.server": 5, "in-process": 5},
        "prefill": {"wsserver": 5, "llama_cpp.server": 2},
    }


async def run(opts: Options, lineup: LlamaLineup) -> dict[str, Any]:
    assert lineup.inproc is not None and lineup.ws is not None
    quick = opts.quick
    reps = _reps(opts)
    stream_s = 0.05 if quick else 0.5
    long_tokens = LONG_TOKENS_QUICK if quick else LONG_TOKENS
    limit = 60.0 if quick else 120.0  # per measurement
    rng = random.Random(6)
    decode_step_ms = lineup.decode_step_ms
    if decode_step_ms is None:
        probe = await lineup.inproc.complete(PROMPTS[0], 32)
        tps = probe.decode_tps(probe.pieces)
        decode_step_ms = 1000 / tps if tps else 20.0
    step_s = decode_step_ms / 1000

    # wsserver at --baseline REF: the same scenarios, as often, right after the working tree's.
    twins = [lineup.ws] + ([lineup.ws_baseline] if lineup.ws_baseline is not None else [])
    contenders: dict[str, Any] = {"in-process": lineup.inproc}
    contenders.update({twin.name: twin for twin in twins})
    if lineup.peer is not None:
        contenders["llama_cpp.server"] = lineup.peer

    async def measure(name: str, scenario: Any, nxt: str, seconds: float) -> dict[str, Any]:
        """The short follow-up on the warm, idle model first (its TTFT is the reference),
        then the cancel scenario ending with the same follow-up. The reference
        sits right next to the measurement, so machine drift hits both alike;
        the long request in between replaces the cached prompt, so neither run
        of the follow-up reuses the other's prefix."""
        contender = contenders[name]
        # Warm the model first: right after a cancel it has just been decoding,
        # and a model that sat idle answers measurably slower (threads asleep).
        await contender.complete(f"Warm-up {len(nxt)}: one, two, three,", WARM_TOKENS)
        reference = await contender.complete(nxt, NEXT_TOKENS)
        sample = await _bounded(scenario, seconds)
        sample["next_prompt"] = nxt
        sample["idle_ttft_ms"] = reference.ttft_ms
        if sample.get("next_first_ms") is not None and reference.ttft_ms is not None:
            sample["busy_ms"] = sample["next_first_ms"] - reference.ttft_ms
        return sample

    # Prefill reference: how long the in-process call takes to its first token.
    ref_prompt, prompt_tokens = long_prompt(lineup.inproc, 999)
    ref = await lineup.inproc.complete(ref_prompt, 1)
    prefill_s = ref.since_sent(ref.first if ref.first is not None else ref.end) or 0.0
    delay_s = min(1.0, 0.3 * prefill_s)
    opts.log(
        f"  cancel: a {prompt_tokens}-token prompt takes {prefill_s:.2f} s to first token "
        f"in-process; cancelling {delay_s:.2f} s into it"
    )

    decode: dict[str, list[dict[str, Any]]] = {n: [] for n in contenders}
    for i in range(max(reps["decode"].values())):
        prompt = PROMPTS[(i + 5) % len(PROMPTS)] + f" (part {i})"
        nxt = NEXT_PROMPTS[i % len(NEXT_PROMPTS)]
        if i < reps["decode"]["wsserver"]:
            jitter = rng.uniform(0, step_s)
            for twin in twins:
                scenario = ws_mid_decode(twin, prompt, nxt, stream_s, jitter, long_tokens)
                decode[twin.name].append(await measure(twin.name, scenario, nxt, limit))
        if lineup.peer is not None and i < reps["decode"]["llama_cpp.server"]:
            jitter = rng.uniform(0, step_s)
            scenario = peer_mid_decode(lineup.peer, prompt, nxt, stream_s, jitter, long_tokens)
            decode["llama_cpp.server"].append(
                await measure("llama_cpp.server", scenario, nxt, limit)
            )
        if i < reps["decode"]["in-process"]:
            scenario = asyncio.to_thread(
                inproc_mid_decode, lineup.inproc, prompt, nxt, stream_s, long_tokens
            )
            decode["in-process"].append(await measure("in-process", scenario, nxt, limit))
    opts.log("  cancel: mid-decode done")

    prefill: dict[str, list[dict[str, Any]]] = {n: [] for n in contenders if n != "in-process"}
    for i in range(max(reps["prefill"].values())):
        prompt, _ = long_prompt(lineup.inproc, i)
        nxt = NEXT_PROMPTS[(i + 1) % len(NEXT_PROMPTS)]
        if i < reps["prefill"]["wsserver"]:
            for twin in twins:
                scenario = ws_mid_prefill(twin, prompt, nxt, delay_s)
                prefill[twin.name].append(await measure(twin.name, scenario, nxt, limit))
        if lineup.peer is not None and i < reps["prefill"]["llama_cpp.server"]:
            opts.log(
                f"  cancel: llama_cpp.server mid-prefill {i + 1}/{reps['prefill']['llama_cpp.server']} "
                "(its next request waits for the abandoned prefill) …"
            )
            scenario = peer_mid_prefill(lineup.peer, prompt, nxt, delay_s)
            prefill["llama_cpp.server"].append(
                await measure("llama_cpp.server", scenario, nxt, 10 * limit)
            )
    opts.log("  cancel: mid-prefill done")

    rows: list[dict[str, Any]] = []
    for phase, data in (("mid-decode", decode), ("mid-prefill", prefill)):
        for name, samples in data.items():
            rows.append(
                {
                    "phase": phase,
                    "contender": name,
                    "n": len(samples),
                    **{
                        key: summary(s.get(key) for s in samples)
                        for key in ("ack_ms", "next_first_ms", "busy_ms")
                    },
                    "idle_ttft_ms": median(s.get("idle_ttft_ms") for s in samples),
                    "timeouts": sum(1 for s in samples if s["next_first_ms"] is None),
                    "in_prefill": sum(1 for s in samples if s.get("in_prefill"))
                    if phase == "mid-prefill"
                    else None,
                    "reasons": sorted({str(s.get("reason")) for s in samples if s.get("reason")}),
                }
            )
    ws_rows = {r["phase"]: r for r in rows if r["contender"] == "wsserver"}
    bound = decode_step_ms + 5
    targets = []
    for phase, limit, label in (
        ("mid-decode", bound, f"one decode step + 5 ms = {bound:.1f} ms"),
        ("mid-prefill", 50.0, "50 ms"),
    ):
        r = ws_rows.get(phase)
        for key, what in (("ack_ms", "cancel → done"), ("busy_ms", "model busy after cancel")):
            value = r[key]["median"] if r else None
            worst = r[key]["max"] if r else None
            targets.append(
                target(
                    f"wsserver {phase}: {what} ≤ {label}",
                    value,
                    lambda v, limit=limit: v <= limit,
                    f"{{:.1f}} ms (worst {worst or 0:.1f})",
                    worst=worst,
                )
            )
    for r in rows:
        opts.log(
            f"    {r['phase']:<11} {r['contender']:<18} ack {fmt(r['ack_ms']['median'])} ms, "
            f"next first token {fmt(r['next_first_ms']['median'])} ms, busy {fmt(r['busy_ms']['median'])} ms"
        )
    return {
        "status": "ok",
        "params": {
            "stream_before_cancel_s": stream_s,
            "prefill_prompt_tokens": prompt_tokens,
            "prefill_reference_s": prefill_s,
            "cancel_after_s": delay_s,
            "decode_step_ms": decode_step_ms,
            "next_tokens": NEXT_TOKENS,
            "reps": reps,
        },
        "rows": rows,
        "targets": targets,
        "raw": {"decode": decode, "prefill": prefill},
    }


def headlines(cn: dict[str, Any]) -> list[str]:
    """The summary table's rows: cancel → done and the next request, each phase."""
    lines = []
    for phase in ("mid-decode", "mid-prefill"):
        ws = row(cn, "wsserver", phase)
        peer = row(cn, "llama_cpp.server", phase)
        if ws is None:
            continue
        text = (
            f"wsserver: done after **{fmt(ws['ack_ms']['median'])} ms**, next request's first token after "
            f"{fmt(ws['next_first_ms']['median'])} ms (model busy {fmt(ws['busy_ms']['median'])} ms)"
        )
        if peer is not None:
            text += (
                f"; llama_cpp.server (close the stream): next request's first token after "
                f"**{fmt(peer['next_first_ms']['median'])} ms**"
            )
        lines.append(f"| cancel {phase} | {text} |")
    return lines


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["targets"])


def render(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        f"Mid-decode: cancel after {p['stream_before_cancel_s']:g} s of streaming plus a random part of one "
        f"decode step ({p['decode_step_ms']:.1f} ms in-process). Mid-prefill: a {p['prefill_prompt_tokens']:,}-token "
        f"prompt (in-process it takes {p['prefill_reference_s']:.2f} s to its first token), cancelled "
        f"{p['cancel_after_s']:.2f} s after it was sent. The next request is a short prompt "
        f"({p['next_tokens']} tokens) sent right after the ack (wsserver) or right after closing the stream "
        "(llama_cpp.server). *Model busy after cancel* = next first token - the same prompt's TTFT on "
        "the idle but warm model (right after a short generation), measured just before each cancel, so "
        "machine load hits both alike; it can come out slightly negative. Figures are medians, worst in "
        "brackets.",
        "",
        "| phase | contender | n | cancel → done (ms) | cancel → next first token (ms) "
        "| idle TTFT of next (ms) | model busy after cancel (ms) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ack = (
            "no cancel message"
            if r["contender"] == "llama_cpp.server"
            else (f"{fmt(r['ack_ms']['median'])} ({fmt(r['ack_ms']['max'])})")
        )
        nxt = f"{fmt(r['next_first_ms']['median'])} ({fmt(r['next_first_ms']['max'])})"
        if r["timeouts"]:
            nxt += f", {r['timeouts']} timed out"
        lines.append(
            f"| {r['phase']} | {r['contender']} | {r['n']} | {ack} | {nxt} | {fmt(r['idle_ttft_ms'])} "
            f"| {fmt(r['busy_ms']['median'])} ({fmt(r['busy_ms']['max'])}) |"
        )
    lines += [
        "",
        "In-process mid-prefill: not measurable — the call cannot be interrupted; the caller "
        f"waits for the whole prefill ({p['prefill_reference_s']:.2f} s here).",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], plt: Any, out_dir: Any) -> list[str]:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, phase in zip(axes, ("mid-decode", "mid-prefill"), strict=True):
        rows = [r for r in result["rows"] if r["phase"] == phase]
        names = [r["contender"] for r in rows]
        values = [r["next_first_ms"]["median"] or 0 for r in rows]
        ax.bar(
            names,
            values,
            color=[
                "#777" if n == "in-process" else "#2a7" if n == "wsserver" else "#c63"
                for n in names
            ],
        )
        ax.set_yscale("log")
        ax.set_title(f"{phase}: cancel → next request's first token (ms)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        for x, v in enumerate(values):
            ax.annotate(f"{v:,.0f}", (x, v), ha="center", va="bottom", fontsize=8)
    return save_plot(fig, plt, out_dir, "cancel.png")


def notes(r: dict[str, Any]) -> list[str]:
    notes = []
    for t in r.get("targets", []):
        if t.get("met") is not False:
            continue
        why = ""
        if "busy" in t["name"]:
            why = (
                " Between the cancel and the next request's start, the producer must notice the cancel "
                "(llama.cpp's abort callback, polled between graph nodes, interrupts the decode in flight), "
                "the slot's context is cleared, the producer thread exits and the slot returns to the "
                "scheduler; the next request's first delta then pays the usual first-token hand-off "
                "(section 1). On this shared 2-core machine single samples also vary by tens of ms (see the "
                "idle TTFT column). What would close it: find which of those steps dominates from the "
                "server's own timings (`done.timings`, the cancel-latency histogram in /metrics)."
            )
        elif "done" in t["name"]:
            why = (
                " `done` is sent by the event loop as soon as it reads the cancel, so a slow ack means the "
                "loop itself was late: see the loop-lag figures in section 3."
            )
        notes.append(f"**Missed: {t['name']}** — measured {t['shown']}.{why}")
    base = row(r, "in-process", "mid-decode")
    if base is not None and (base["busy_ms"]["median"] or 0) < 0:
        notes.append(
            "In-process comes out *negative* on model-busy-after-cancel "
            f"({base['busy_ms']['median']:+.0f} ms): its follow-up runs while the model is still "
            "hot from the cancelled decode, which answers faster than the reference taken after a short "
            "warm-up and a pause. wsserver's figure carries the same bias, so read it against the "
            "in-process and llama_cpp.server figures rather than against zero."
        )
    peer = row(r, "llama_cpp.server", "mid-prefill")
    ws = row(r, "wsserver", "mid-prefill")
    if peer is not None and ws is not None and peer["next_first_ms"]["median"]:
        notes.append(
            f"After a client abandons a {r['params']['prefill_prompt_tokens']:,}-token prompt, the next request "
            f"on llama_cpp.server waits {peer['next_first_ms']['median'] / 1000:.1f} s: closing the stream does "
            "not stop llama.cpp's prompt processing (only the abort callback can), and the server notices the "
            "disconnect only when it tries to send the first token. wsserver sets the abort callback, so the "
            f"same cancel frees the model in {fmt(ws['busy_ms']['median'])} ms."
        )
    in_prefill = ws.get("in_prefill") if ws else None
    if ws is not None and in_prefill is not None and in_prefill < ws["n"]:
        notes.append(
            f"Only {in_prefill} of {ws['n']} wsserver cancels landed inside the prefill (the prompt was "
            "processed faster than the cancel delay); those figures mix in mid-decode cancels."
        )
    return notes

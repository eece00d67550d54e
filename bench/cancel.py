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
import statistics
import time
from typing import Any

from .common import fmt, summary
from .contenders import InProcess, PeerContender, WsContender
from .lineup import NEXT_PROMPTS, PROMPTS, LlamaLineup, long_prompt
from .options import Options

now = time.perf_counter
NEXT_TOKENS = 8
WARM_TOKENS = 16
LONG_TOKENS = 1000
#: Quick mode runs on a tiny random-weight model whose garbled bytes make
#: llama-cpp-python's streaming slow down with length: keep requests short.
LONG_TOKENS_QUICK = 60


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


# ------------------------------------------------------------------ wsserver


async def _ws_next(ws: WsContender, prompt: str, t0: float) -> float | None:
    stream = ws.client.generate(prompt=prompt, max_tokens=NEXT_TOKENS, temperature=0)
    first = None
    async for _ in stream:
        if first is None:
            first = now()
    return None if first is None else first - t0


async def ws_mid_decode(
    ws: WsContender,
    prompt: str,
    nxt: str,
    stream_s: float,
    jitter_s: float,
    long_tokens: int = LONG_TOKENS,
) -> dict[str, Any]:
    stream = ws.client.generate(prompt=prompt, max_tokens=long_tokens, temperature=0)
    first = None
    async for _ in stream:
        if first is None:
            first = now()
        if now() - first >= stream_s:
            break
    await asyncio.sleep(jitter_s)  # land the cancel at a random point of a decode step
    t0 = now()
    done = await ws.client.cancel(stream.id)
    ack = now() - t0
    return {
        "ack_ms": _ms(ack),
        "next_first_ms": _ms(await _ws_next(ws, nxt, t0)),
        "reason": getattr(done, "reason", None),
    }


async def ws_mid_prefill(ws: WsContender, prompt: str, nxt: str, delay_s: float) -> dict[str, Any]:
    stream = ws.client.generate(prompt=prompt, max_tokens=NEXT_TOKENS, temperature=0)
    await stream.send()
    await asyncio.sleep(delay_s)  # the scenario: the user gives up this far into the prefill
    in_prefill = stream.started and not stream.deltas and stream.done is None
    t0 = now()
    done = await ws.client.cancel(stream.id)
    ack = now() - t0
    return {
        "ack_ms": _ms(ack),
        "next_first_ms": _ms(await _ws_next(ws, nxt, t0)),
        "reason": getattr(done, "reason", None),
        "in_prefill": in_prefill,
    }


# ------------------------------------------------------------------ peer


async def _peer_next(peer: PeerContender, prompt: str, t0: float, timeout: float) -> float | None:
    stream = await peer.connect()
    try:
        await peer.send(stream, prompt, NEXT_TOKENS)
        async with asyncio.timeout(timeout):
            async for event in stream.events():
                if event["choices"][0].get("text"):
                    return now() - t0
    except TimeoutError:
        return None
    finally:
        stream.abort()
    return None


async def peer_mid_decode(
    peer: PeerContender,
    prompt: str,
    nxt: str,
    stream_s: float,
    jitter_s: float,
    long_tokens: int = LONG_TOKENS,
) -> dict[str, Any]:
    stream = await peer.connect()
    await peer.send(stream, prompt, long_tokens)
    first = None
    async for event in stream.events():
        if event["choices"][0].get("text") and first is None:
            first = now()
        if first is not None and now() - first >= stream_s:
            break
    await asyncio.sleep(jitter_s)
    t0 = now()
    stream.abort()
    return {"ack_ms": None, "next_first_ms": _ms(await _peer_next(peer, nxt, t0, 120))}


async def peer_mid_prefill(
    peer: PeerContender, prompt: str, nxt: str, delay_s: float
) -> dict[str, Any]:
    stream = await peer.connect()
    await peer.send(stream, prompt, NEXT_TOKENS)
    await asyncio.sleep(delay_s)
    t0 = now()
    stream.abort()
    return {"ack_ms": None, "next_first_ms": _ms(await _peer_next(peer, nxt, t0, 600))}


# ------------------------------------------------------------------ in-process


def inproc_mid_decode(
    inproc: InProcess, prompt: str, nxt: str, stream_s: float, long_tokens: int = LONG_TOKENS
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
        "next_first_ms": _ms(ack + run.first) if run.first is not None else None,
    }


# ------------------------------------------------------------------ section


async def _bounded(awaitable: Any, seconds: float) -> dict[str, Any]:
    """One measurement, or a record that it did not finish in ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            return dict(await awaitable)
    except TimeoutError:
        return {"ack_ms": None, "next_first_ms": None, "error": f"no result within {seconds:g} s"}


async def run(opts: Options, session: LlamaLineup, decode_step_ms: float | None) -> dict[str, Any]:
    assert session.inproc is not None and session.ws is not None
    quick = opts.quick
    reps = (
        {
            "decode": {"wsserver": 2, "llama_cpp.server": 1, "in-process": 1},
            "prefill": {"wsserver": 1, "llama_cpp.server": 1},
        }
        if quick
        else {
            "decode": {"wsserver": 10, "llama_cpp.server": 5, "in-process": 5},
            "prefill": {"wsserver": 5, "llama_cpp.server": 2},
        }
    )
    if opts.repeats and not quick:
        n = opts.repeats
        reps = {
            "decode": {
                "wsserver": n,
                "llama_cpp.server": max(1, n // 2),
                "in-process": max(1, n // 2),
            },
            "prefill": {"wsserver": max(1, n // 2), "llama_cpp.server": 1},
        }
    stream_s = 0.05 if quick else 0.5
    long_tokens = LONG_TOKENS_QUICK if quick else LONG_TOKENS
    limit = 60.0 if quick else 120.0  # per measurement
    rng = random.Random(6)
    if decode_step_ms is None:
        probe = await session.inproc.complete(PROMPTS[0], 32)
        tps = probe.decode_tps(probe.pieces)
        decode_step_ms = 1000 / tps if tps else 20.0
    step_s = decode_step_ms / 1000

    names = ["in-process", "wsserver"] + (["llama_cpp.server"] if session.peer is not None else [])
    contenders: dict[str, Any] = {
        "in-process": session.inproc,
        "wsserver": session.ws,
        "llama_cpp.server": session.peer,
    }
    # wsserver at --baseline REF: the same scenarios, as often, right after the working tree's.
    twins = [session.ws] + ([session.ws_baseline] if session.ws_baseline is not None else [])
    for twin in twins[1:]:
        names.insert(2, twin.name)
        contenders[twin.name] = twin

    async def measure(name: str, scenario: Any, nxt: str, seconds: float) -> dict[str, Any]:
        """The short follow-up on the warm, idle model first (its TTFT is the reference),
        then the cancel scenario ending with the same follow-up. The reference
        sits right next to the measurement, so machine drift hits both alike;
        the long request in between replaces the cached prompt, so neither run
        of the follow-up reuses the other's prefix."""
        contender = contenders[name]
        assert contender is not None
        # Warm the model first: right after a cancel it has just been decoding,
        # and a model that sat idle answers measurably slower (threads asleep).
        await contender.complete(f"Warm-up {len(nxt)}: one, two, three,", WARM_TOKENS)
        reference = await contender.complete(nxt, NEXT_TOKENS)
        sample = await _bounded(scenario, seconds)
        sample["next_prompt"] = nxt
        sample["idle_ttft_ms"] = _ms(reference.first)
        if sample.get("next_first_ms") is not None and reference.first is not None:
            sample["busy_ms"] = sample["next_first_ms"] - 1000 * reference.first
        return sample

    # Prefill reference: how long the in-process call takes to its first token.
    ref_prompt, prompt_tokens = long_prompt(session.inproc, 999)
    ref = await session.inproc.complete(ref_prompt, 1)
    prefill_s = ref.first or ref.end
    delay_s = min(1.0, 0.3 * prefill_s)
    opts.log(
        f"  cancel: a {prompt_tokens}-token prompt takes {prefill_s:.2f} s to first token "
        f"in-process; cancelling {delay_s:.2f} s into it"
    )

    decode: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(max(reps["decode"].values())):
        prompt = PROMPTS[(i + 5) % len(PROMPTS)] + f" (part {i})"
        nxt = NEXT_PROMPTS[i % len(NEXT_PROMPTS)]
        if i < reps["decode"]["wsserver"]:
            jitter = rng.uniform(0, step_s)
            for twin in twins:
                decode[twin.name].append(
                    await measure(
                        twin.name,
                        ws_mid_decode(twin, prompt, nxt, stream_s, jitter, long_tokens),
                        nxt,
                        limit,
                    )
                )
        if session.peer is not None and i < reps["decode"]["llama_cpp.server"]:
            jitter = rng.uniform(0, step_s)
            decode["llama_cpp.server"].append(
                await measure(
                    "llama_cpp.server",
                    peer_mid_decode(session.peer, prompt, nxt, stream_s, jitter, long_tokens),
                    nxt,
                    limit,
                )
            )
        if i < reps["decode"]["in-process"]:
            decode["in-process"].append(
                await measure(
                    "in-process",
                    asyncio.to_thread(
                        inproc_mid_decode, session.inproc, prompt, nxt, stream_s, long_tokens
                    ),
                    nxt,
                    limit,
                )
            )
    opts.log("  cancel: mid-decode done")

    prefill: dict[str, list[dict[str, Any]]] = {n: [] for n in names if n != "in-process"}
    for i in range(max(reps["prefill"].values())):
        prompt, _ = long_prompt(session.inproc, i)
        nxt = NEXT_PROMPTS[(i + 1) % len(NEXT_PROMPTS)]
        if i < reps["prefill"]["wsserver"]:
            for twin in twins:
                prefill[twin.name].append(
                    await measure(twin.name, ws_mid_prefill(twin, prompt, nxt, delay_s), nxt, limit)
                )
        if session.peer is not None and i < reps["prefill"]["llama_cpp.server"]:
            opts.log(
                f"  cancel: llama_cpp.server mid-prefill {i + 1}/{reps['prefill']['llama_cpp.server']} "
                "(its next request waits for the abandoned prefill) …"
            )
            prefill["llama_cpp.server"].append(
                await measure(
                    "llama_cpp.server",
                    peer_mid_prefill(session.peer, prompt, nxt, delay_s),
                    nxt,
                    10 * limit,
                )
            )
    opts.log("  cancel: mid-prefill done")

    rows = []
    for phase, data in (("mid-decode", decode), ("mid-prefill", prefill)):
        for name, samples in data.items():
            nexts = [s["next_first_ms"] for s in samples if s["next_first_ms"] is not None]
            acks = [s["ack_ms"] for s in samples if s["ack_ms"] is not None]
            busy = [s["busy_ms"] for s in samples if s.get("busy_ms") is not None]
            idles = [s["idle_ttft_ms"] for s in samples if s.get("idle_ttft_ms") is not None]
            rows.append(
                {
                    "phase": phase,
                    "contender": name,
                    "n": len(samples),
                    "ack_ms": summary(acks),
                    "next_first_ms": summary(nexts),
                    "busy_ms": summary(busy),
                    "idle_ttft_ms": statistics.median(idles) if idles else None,
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
                {
                    "name": f"wsserver {phase}: {what} ≤ {label}",
                    "value": value,
                    "worst": worst,
                    "shown": "-" if value is None else f"{value:.1f} ms (worst {worst:.1f})",
                    "met": None if value is None else bool(value <= limit),
                }
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
    fig.tight_layout()
    path = out_dir / "cancel.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]

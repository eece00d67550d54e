"""The prose of docs/benchmarks.md: headline figures, targets, and why.

Generated from the results, so a re-run cannot leave stale explanations
behind: each note below is written only when the figures call for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import fmt


def _ok(result: dict[str, Any] | None) -> bool:
    return bool(result) and result.get("status") == "ok"  # type: ignore[union-attr]


def _row(result: dict[str, Any], contender: str, phase: str | None = None) -> dict[str, Any] | None:
    for r in result.get("rows", []):
        if r.get("contender") == contender and (phase is None or r.get("phase") == phase):
            return dict(r)
    return None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key in ("throughput", "cancel", "page", "upstream", "batched", "structured", "responses"):
        result = results.get(key)
        if _ok(result):
            if key == "batched":
                from .batched import targets as batched_targets

                out += batched_targets(result)
            elif key == "structured":
                from .structured_report import targets as structured_targets

                out += structured_targets(result)
            elif key == "responses":
                from .responses import targets as responses_targets

                out += responses_targets(result)
            else:
                out += result["targets"]
        elif result is not None:
            out.append({"name": f"section {key}", "shown": "not measured", "met": None})
    return out


def summary(results: dict[str, Any]) -> list[str]:
    lines = ["| measure | result |", "|---|---|"]
    tp = results.get("throughput")
    if _ok(tp):
        base, ws, peer = _row(tp, "in-process"), _row(tp, "wsserver"), _row(tp, "llama_cpp.server")
        assert base is not None and ws is not None
        lines.append(
            f"| decode throughput, `{Path(tp['params']['model']).name}` | in-process {fmt(base['decode_tps']['median'])} tokens/s; "
            f"wsserver {fmt(ws['decode_tps']['median'])} (**{fmt(ws['decode_ratio_paired'], 3)}x**)"
            + (
                f"; llama_cpp.server {fmt(peer['decode_tps']['median'])} ({fmt(peer['decode_ratio_paired'], 3)}x)"
                if peer
                else ""
            )
            + " |"
        )
        lines.append(
            f"| time to first token (median) | in-process {fmt(base['ttft_ms']['median'])} ms; "
            f"wsserver {fmt(ws['ttft_ms']['median'])} ms (**{ws['ttft_delta_ms_paired']:+.1f} ms**)"
            + (f"; llama_cpp.server {fmt(peer['ttft_ms']['median'])} ms" if peer else "")
            + " |"
        )
    cn = results.get("cancel")
    if _ok(cn):
        for phase in ("mid-decode", "mid-prefill"):
            ws = _row(cn, "wsserver", phase)
            peer = _row(cn, "llama_cpp.server", phase)
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
    ce = results.get("ceiling")
    if _ok(ce):
        best = max(ce["rows"], key=lambda r: r["tokens_per_s"])
        lines.append(
            f"| server ceiling (fake backend) | {fmt(best['tokens_per_s'], 0)} tokens/s, "
            f"{fmt(best['frames_per_s'], 0)} frames/s at {best['concurrency']} connections ({best['mode']}); "
            f"{fmt(best['cpu_s_per_1k_tokens'], 4)} CPU s per 1k tokens |"
        )
    sl = results.get("slow")
    if _ok(sl):
        lines.append(
            f"| 16 slow consumers | largest server-side buffer {sl['max_buffered_bytes'] / 1024:.1f} KiB per "
            f"connection, RSS +{sl['rss_growth_bytes'] / 1024:,.0f} KiB, producer CPU while blocked "
            f"{sl['producer_blocked_cpu_s']:.3f} s over {fmt(sl['producer_blocked_s'])} s blocked, "
            f"texts complete {sl['texts_complete']}/{sl['texts_total']}"
            + (
                f" (with the stall guard off: {sl['no_stall_timeout']['texts_complete']}/"
                f"{sl['no_stall_timeout']['texts_total']})"
                if sl.get("no_stall_timeout")
                else ""
            )
            + " |"
        )
    il = results.get("idle")
    if _ok(il):
        extra = ""
        if "no_compression" in il:
            extra = f" ({il['no_compression']['bytes_per_connection'] / 1024:.1f} KiB without permessage-deflate)"
        lines.append(
            f"| memory per idle connection | {il['bytes_per_connection'] / 1024:.1f} KiB{extra} |"
        )
    pg = results.get("page")
    if _ok(pg):
        from .page import summary_line

        lines.append(summary_line(pg))
    oa = results.get("openai")
    if _ok(oa):
        from .openai_sse import headline

        lines.append(f"| OpenAI API over SSE (section 8) | {headline(oa)} |")
    up = results.get("upstream")
    if _ok(up):
        from .upstream import summary_lines

        lines += summary_lines(up)
    bt = results.get("batched")
    if _ok(bt):
        from .batched import summary_line as batched_line

        lines.append(batched_line(bt))
    st = results.get("structured")
    if _ok(st):
        from .structured_report import summary_line as structured_line

        lines.append(structured_line(st))
    rp = results.get("responses")
    if _ok(rp):
        from .responses import summary_line as responses_line

        lines.append(responses_line(rp))
    md = results.get("models")
    if _ok(md):
        from .models import summary_line as models_line

        lines.append(models_line(md))
    rs = results.get("resume")
    if _ok(rs):
        worst, latency = rs["worst"], rs["latency"]["connect_to_replay_ms"]
        lines.append(
            "| resumable streams (section 11) | a detached request held at most "
            f"{worst['max_held_bytes'] / 1024:.1f} KiB (bound {worst['bound_bytes'] / 1024:.0f} KiB); "
            f"new connection → first replayed delta {fmt(latency['median'], 2)} ms median |"
        )
    skipped = [k for k, v in results.items() if v.get("status") != "ok"]
    for key in skipped:
        lines.append(f"| section {key} | not measured: {results[key].get('reason', '?')} |")
    lines += ["", "### Targets", "", "| target | result | met |", "|---|---|:-:|"]
    for t in targets(results):
        mark = "-" if t.get("met") is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['name']} | {t.get('shown', '-')} | {mark} |")
    missed = [t for t in targets(results) if t.get("met") is False]
    lines += [""]
    if missed:
        lines.append(
            "Missed targets are explained under their sections below, with what would close them."
        )
    elif targets(results):
        lines.append("Every target that was measured was met.")
    found = problems(results)
    if found:
        lines += ["", "### Problems found", ""]
        lines += [f"- {p}" for p in found]
        lines += ["", "Each is explained under its section below, with what would close it."]
    return lines


def problems(results: dict[str, Any]) -> list[str]:
    """Findings outside the numeric targets that a reader of the summary must see."""
    out = []
    sl = results.get("slow")
    if _ok(sl) and sl["texts_complete"] < sl["texts_total"]:
        out.append(
            f"Slow consumers (section 4): with the default settings only {sl['texts_complete']} of "
            f"{sl['texts_total']} slow but live readers received their whole text "
            f"(done: {', '.join(sl['done_reasons'])})."
        )
    ce = results.get("ceiling")
    if _ok(ce) and ce.get("paced"):
        base = [x["cpu_s_per_1k_tokens"] for x in ce["rows"] if x["cpu_s_per_1k_tokens"]]
        paced = [x["cpu_s_per_1k_tokens"] for x in ce["paced"] if x["cpu_s_per_1k_tokens"]]
        # Above 1 CPU s per 1,000 tokens a stream at 50 tokens/s costs over 5 % of a core.
        if base and paced and max(paced) > 1.0:
            out.append(
                f"CPU per token at a real model's rate (section 3): up to {max(paced):.2f} CPU s per "
                f"1,000 tokens at 50 tokens/s per connection, {max(paced) / min(base):.0f}x the cost at "
                "unlimited rate."
            )
    return out


def section_notes(key: str, results: dict[str, Any]) -> list[str]:
    result = results.get(key) or {}
    notes: list[str] = []
    if key == "throughput":
        notes += _throughput_notes(result)
    elif key == "cancel":
        notes += _cancel_notes(result)
    elif key == "ceiling":
        notes += _ceiling_notes(result)
    elif key == "slow":
        notes += _slow_notes(result)
    elif key == "idle":
        notes += _idle_notes(result)
    elif key == "structured" and _ok(result):
        from .structured_report import notes as structured_notes

        notes += structured_notes(result)
    elif key == "page" and _ok(result):
        from .page import notes as page_notes

        notes += page_notes(result)
    out: list[str] = []
    for note in notes:
        out += [note, ""]
    return out


def _throughput_notes(r: dict[str, Any]) -> list[str]:
    notes = []
    ws = _row(r, "wsserver")
    fixed = _row(r, "wsserver+nodelay")
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
            base = _row(r, "in-process")
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
        if fixed is not None:
            text = (
                "Separately, accepted sockets do not have `TCP_NODELAY`: `make_listening_socket()` creates "
                "the listening socket as `socket.socket(family, SOCK_STREAM)` (protocol 0), and asyncio only "
                "turns on `TCP_NODELAY` for sockets whose `proto` is `IPPROTO_TCP`; accepted sockets inherit "
                "protocol 0. Nagle's algorithm then holds a small frame while the previous one is "
                "unacknowledged, and the client's delayed ACK can release it up to ~40 ms later. The "
                "diagnostic contender `wsserver+nodelay` (the same server, listening socket re-created with "
                f"`IPPROTO_TCP`) has TTFT {fixed['ttft_delta_ms_paired']:+.1f} ms from in-process: with this "
                "model's prompt processing it matters little, but with the fake backend every first delta "
                "waits ~40 ms (section 3). Fix: create the listening socket with the protocol `getaddrinfo` "
                "returns, or set `TCP_NODELAY` on each accepted socket, in `wsserver/server.py`."
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
    peer = _row(r, "llama_cpp.server")
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


def _cancel_notes(r: dict[str, Any]) -> list[str]:
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
    base = _row(r, "in-process", "mid-decode")
    if base is not None and (base["busy_ms"]["median"] or 0) < 0:
        notes.append(
            "In-process comes out *negative* on model-busy-after-cancel "
            f"({base['busy_ms']['median']:+.0f} ms): its follow-up runs while the model is still "
            "hot from the cancelled decode, which answers faster than the reference taken after a short "
            "warm-up and a pause. wsserver's figure carries the same bias, so read it against the "
            "in-process and llama_cpp.server figures rather than against zero."
        )
    peer = _row(r, "llama_cpp.server", "mid-prefill")
    ws = _row(r, "wsserver", "mid-prefill")
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


def _ceiling_notes(r: dict[str, Any]) -> list[str]:
    rows = r.get("rows", [])
    notes = []
    one = [x for x in rows if x["concurrency"] == 1]
    if one and any(x.get("tcp_nodelay") is False for x in rows):
        notes.append(
            f"One connection delivers only {fmt(one[0]['tokens_per_s'], 0)} tokens/s with the server nearly idle "
            f"({fmt(one[0]['server_cores'], 2)} cores): each request's first delta waits ~40 ms for the "
            "client's delayed ACK because accepted sockets lack `TCP_NODELAY` (see section 1), and the client "
            "waits for each request's `done` before sending the next. That, not the server's speed, limits "
            "the 1- and 8-connection rows."
        )
    per_frame = [x for x in rows if x["mode"] == "per-token"]
    if per_frame and all((x["tokens_per_frame"] or 0) > 2 for x in per_frame):
        notes.append(
            "With `flush_tokens = 1, flush_ms = 0` frames still carry many tokens at unlimited rate: the sender "
            "merges whatever already waits in the channel into one frame (a producer at unlimited rate fills "
            "the 64-token channel while one frame is sent). So the two modes differ little here; at a model's "
            "real rate (tens of tokens/s) the per-token setting sends one frame per token."
        )
    paced = r.get("paced") or []
    unlimited_cost = [x["cpu_s_per_1k_tokens"] for x in rows if x["cpu_s_per_1k_tokens"]]
    paced_cost = [x["cpu_s_per_1k_tokens"] for x in paced if x["cpu_s_per_1k_tokens"]]
    if unlimited_cost and paced_cost:
        base, slow = min(unlimited_cost), max(paced_cost)
        per_stream = slow * r["params"]["paced_tokens_per_s"] / 1000 * 100
        notes.append(
            f"**CPU per token at a real model's rate.** Paced at "
            f"{r['params']['paced_tokens_per_s']} tokens/s per connection the server spends up to "
            f"{slow:.3f} CPU s per 1,000 tokens ({per_stream:.1f} % of one core per stream), "
            f"{slow / base:.0f}x its cost at unlimited rate, where one frame and one wake-up of the "
            "event loop carry many tokens. At a real rate each token wakes the loop on its own: janus "
            "hands it over with a cross-thread call and a task, then the sender waits for the flush "
            "window. What would lower it: a channel that wakes the loop once per flush window rather "
            "than once per token. (An earlier version also spun while part of a character was held "
            "back; that was fixed in `Connection._pump` and this figure is after the fix.)"
        )
    hot = [x for x in rows if (x["lag_p99_ms"] or 0) > 50]
    if hot:
        notes.append(
            f"Loop lag grows past 50 ms from {min(x['concurrency'] for x in hot)} connections: the server "
            "process is at one core (Python's GIL), shared by the event loop and every producer thread, "
            "each producing as fast as it can. A real model produces tens of tokens/s per connection, far "
            "below this ceiling."
        )
    return notes


def _slow_notes(r: dict[str, Any]) -> list[str]:
    if not r or r.get("status") != "ok":
        return []
    notes = []
    if r["texts_complete"] != r["texts_total"]:
        stalled = any("stalled" in x for x in r["done_reasons"])
        text = (
            f"**Problem: texts incomplete with the default settings.** Only {r['texts_complete']} of "
            f"{r['texts_total']} slow readers received the whole text (done: {', '.join(r['done_reasons'])})."
        )
        if stalled:
            text += (
                " These clients never stop reading; they read slowly. The stall guard "
                "(`stream.stall_timeout_s`) times one blocked `put()` of the producer, and that put "
                "waits for the sender, which waits in websockets' `send()` until the write buffer drains "
                "from its high-water mark (`write_limit`, 16 KiB) to the low one (a quarter of it): "
                "about 12 KiB at the client's read rate, i.e. several seconds at a few KiB/s, longer than "
                "the stall timeout. So a slow but live reader is cut off as if it had stalled. What would "
                "close it: judge a stall by the client's progress (bytes taken off the socket in the last "
                "N seconds) rather than by one blocked put, or lower the low-water mark so the sender "
                "resumes after each frame leaves."
            )
        if r.get("no_stall_timeout"):
            v = r["no_stall_timeout"]
            text += (
                f" With the guard off (second column) {v['texts_complete']}/{v['texts_total']} texts "
                "arrived complete and identical to a fast reader's, with the same bounded buffers."
            )
        notes.append(text)
    notes.append(
        "The server-side buffer is the request's channel (at most `queue_tokens` = 64 tokens) plus the "
        "websockets write buffer; the rest of a slow reader's backlog sits in the two kernels' socket "
        "buffers (16 KiB `SO_SNDBUF`, doubled by Linux, and the client's receive buffer), which is why "
        "the producers are not blocked for the whole run."
    )
    return notes


def _idle_notes(r: dict[str, Any]) -> list[str]:
    if not r or r.get("status") != "ok" or "no_compression" not in r:
        return []
    d, n = r["deflate"]["bytes_per_connection"], r["no_compression"]["bytes_per_connection"]
    if d - n < 8192:
        return []
    return [
        f"permessage-deflate accounts for about {(d - n) / 1024:.0f} KiB of each connection's "
        f"{d / 1024:.0f} KiB: websockets keeps a zlib compressor and decompressor per connection once "
        "the extension is negotiated. Token deltas are short and compress poorly; a server that expects "
        "thousands of idle tabs could turn compression off (`serve(compression=None)`)."
    ]


def method_notes() -> list[str]:
    return [
        "## Method notes",
        "",
        "- Medians over repeats, with p99 (for a handful of repeats, the worst) for latencies; "
        "throughput ratios and TTFT differences are taken per repeat against the in-process run of the "
        "same prompt, then the median, so machine drift between repeats cancels out.",
        "- Temperature 0 (greedy) and the same prompts for every contender; `repeat_penalty = 1.0` is sent "
        "to llama_cpp.server explicitly (its default is 1.1, `create_completion`'s is 1.0). The harness "
        "checks that every contender's text equals the in-process text.",
        "- wsserver runs in its own process (`bench/probe_server.py`) so that clients never share its event "
        "loop or GIL; that wrapper adds a 10 ms loop-lag probe and, in section 4, a 50 ms buffer sampler. "
        "The fake-backend sections lift the per-IP connection limit, the total connection limit and the "
        "client frame-rate limit (`limits.*`), which a load test from one address would otherwise hit.",
        "- The fake-backend load client (`bench/wsload.py`) counts frames instead of validating them so "
        "that the client is not the bottleneck; its CPU use is reported next to the server's.",
    ]

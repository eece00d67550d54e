"""Section 13: the Responses API (issue 25) — what ``previous_response_id`` buys, what its wire costs.

* **Five turns, four ways (default model).** One conversation — a document of
  ~1,000 tokens and a first question, then four more questions — and the time
  to first token of each turn, measured at the client from the send to the
  first text (or reasoning) delta:

  - ``ws``: our WebSocket protocol, ``generate`` with the whole ``messages``
    each turn;
  - ``http_resend``: ``POST /v1/responses`` streamed, the whole conversation
    as input items each turn;
  - ``http_previous``: ``POST /v1/responses`` streamed, ``previous_response_id``
    and only the new question;
  - ``ws_mode``: the Responses WebSocket mode, one socket for the five turns,
    ``previous_response_id`` and only the new question.

  One server (``parallel = 1``: every turn lands on the slot that holds the
  turn before it, so the engine's prefix cache is what is measured), the ways
  one after another, their order rotating every round. Each conversation opens
  with a tag of its own (round and way), so no way reuses another's prefix.
  Temperature 0, 32 tokens per answer; the per-turn figure is the median over
  rounds. ``cached_tokens`` (the server's count of reused prompt tokens) is
  kept beside each TTFT to show the cache at work.

* **The Responses stream's overhead (fake engine).** One stream of N tokens,
  the fake unpaced and flushed after every token (``stream.flush_ms = 0``,
  ``flush_tokens = 1``: a frame per token while the reader keeps up — the
  worst case for a wire whose events are larger), over our protocol, the
  Responses WebSocket mode and the Responses SSE over HTTP, each on one open
  connection, alternating per round: TTFT (send → first text delta) and
  throughput (tokens / (last delta - first delta)) at the client, median over
  rounds; the ratio to our protocol is taken per round, then the median.
  Each measured stream follows an unmeasured one of its own wire: a request
  meets what the one before it left behind (after a long stream, ~0.6 ms
  more to the next first token on any wire), and in a plain rotation each
  wire always followed the same other one. Targets (issue 25): TTFT within
  +1 ms, throughput at least 0.98x ours.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import orjson

from .common import Skip
from .figures import fmt, target
from .options import Options
from .servers import UNPACED, ServerProcess, llama_model, llama_wsserver
from .timing import Stream, median, pair_deltas, pair_ratios, side_by_side, summary
from .wsload import open_connection, timed, timed_alone

__all__ = ["headlines", "render", "run", "targets"]

WAYS = ("ws", "http_resend", "http_previous", "ws_mode")
LABELS = {
    "ws": "our protocol (whole history)",
    "http_resend": "Responses HTTP (whole history)",
    "http_previous": "Responses HTTP (previous_response_id)",
    "ws_mode": "Responses WebSocket mode (previous_response_id)",
}
WIRES = ("ws", "ws_mode", "http")
WIRE_LABELS = {
    "ws": "our protocol",
    "ws_mode": "Responses WebSocket mode",
    "http": "Responses HTTP (SSE)",
}
QUESTIONS = (
    "Which city does the report say had the highest rainfall?",
    "And the lowest?",
    "What was the average temperature across all the cities?",
    "Which two cities were closest in temperature?",
    "Summarise the report in one sentence.",
)
ROUNDS = 5
ANSWER_TOKENS = 32
FAKE_TOKENS = 16000
FAKE_ROUNDS = 15
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def document(tag: str) -> str:
    """A deterministic weather report of ~1,000 tokens, opened by ``tag``."""
    cities = [
        "Lisbon", "Porto", "Madrid", "Seville", "Valencia", "Lyon", "Nantes", "Turin",
        "Genoa", "Naples", "Bern", "Graz", "Brno", "Krakow", "Gdansk", "Riga", "Tartu",
        "Oslo", "Bergen", "Aarhus", "Malmo", "Tampere", "Cork", "Leeds", "Bristol",
    ]  # fmt: skip
    lines = [f"Report {tag}. Weather observations for the week, by city."]
    for i, city in enumerate(cities):
        lines.append(
            f"{city}: average temperature {8 + (i * 7) % 17} degrees, rainfall "
            f"{(i * 13) % 41} millimetres, wind {5 + (i * 3) % 23} km/h from the "
            f"{('north', 'east', 'south', 'west')[i % 4]}, {3 + i % 5} sunny days."
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ the clients

_TURN_IDS = itertools.count()


def _generate(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "type": "generate",
        "id": f"t{next(_TURN_IDS)}",  # ids are unique per connection
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _turn(stream: Stream, usage: dict[str, Any], rid: Any) -> dict[str, Any]:
    tokens = usage.get("completion_tokens", usage.get("output_tokens", 0))
    cached = usage.get("cached_tokens")
    if cached is None:
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "ttft_ms": stream.ttft_ms,
        "tok_s": stream.decode_tps(tokens) if tokens else None,
        "text": stream.text,
        "tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens", usage.get("input_tokens")),
        "cached_tokens": cached,
        "response_id": rid,
    }


async def _ws_turn(ws: Any, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One ``generate`` on an open connection of our protocol."""
    stream = await timed(ws, _generate(messages, max_tokens))
    return _turn(stream, stream.final["usage"], None)


class _EventReader:
    """Times a Responses stream's events (either transport) into a turn."""

    def __init__(self) -> None:
        self.stream = Stream()

    def feed(self, event: dict[str, Any]) -> dict[str, Any] | None:
        kind = event.get("type")
        if kind == "response.output_text.delta":
            self.stream.piece(event["delta"])
        elif kind == "response.reasoning_text.delta":
            self.stream.piece("")
        elif kind in TERMINAL:
            response = event["response"]
            return _turn(self.stream, response.get("usage") or {}, response["id"])
        elif kind == "error":
            raise RuntimeError(f"wsserver refused a response: {event}")
        return None


async def _http_response(http: Any, base: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed ``POST /v1/responses``."""
    reader = _EventReader()
    done = None
    async with http.post(f"{base}v1/responses", json={**body, "stream": True}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"POST /v1/responses: {reply.status} {await reply.text()}")
        # Read to the body's end, not just to the last event: aiohttp closes a
        # connection whose body was left unread, and the next request's first
        # token would then wait for a new TCP connection.
        async for line in reply.content:
            if line.startswith(b"data: ") and done is None:
                done = reader.feed(orjson.loads(line[6:]))
    if done is None:
        raise RuntimeError("the SSE stream ended before the response")
    return done


async def _socket_response(ws: Any, body: dict[str, Any]) -> dict[str, Any]:
    """One ``response.create`` in WebSocket mode."""
    reader = _EventReader()
    await ws.send(orjson.dumps({"type": "response.create", **body}).decode())
    while True:
        done = reader.feed(orjson.loads(await ws.recv()))
        if done is not None:
            return done


# ------------------------------------------------------------------ 1. five turns


async def _conversation(server: ServerProcess, way: str, tag: str, tokens: int) -> list[Any]:
    """Five turns one way; their TTFTs and cache counts."""
    import aiohttp
    from websockets.asyncio.client import connect

    first = f"{document(tag)}\n\n{QUESTIONS[0]}"
    history: list[dict[str, str]] = []
    previous: str | None = None
    turns = []
    base = server.http
    async with aiohttp.ClientSession() as http:
        socket = await connect(server.url + "v1/responses") if way == "ws_mode" else None
        try:
            for number, question in enumerate(QUESTIONS):
                asked = first if number == 0 else question
                history.append({"role": "user", "content": asked})
                # No model: the server's default one.
                body: dict[str, Any] = {
                    "max_output_tokens": tokens,
                    "temperature": 0,
                }
                if way == "ws":
                    stream = await timed_alone(server.url, _generate(history, tokens))
                    turn = _turn(stream, stream.final["usage"], None)
                elif way == "http_resend":
                    turn = await _http_response(http, base, {**body, "input": history})
                else:
                    body["input"] = asked
                    if previous is not None:
                        body["previous_response_id"] = previous
                    if socket is not None:
                        turn = await _socket_response(socket, body)
                    else:
                        turn = await _http_response(http, base, body)
                previous = turn["response_id"]
                history.append({"role": "assistant", "content": turn["text"]})
                turns.append(
                    {k: turn[k] for k in ("ttft_ms", "prompt_tokens", "cached_tokens", "tokens")}
                )
        finally:
            if socket is not None:
                await socket.close()
    return turns


async def five_turns(opts: Options, model: str, threads: int) -> dict[str, Any]:
    rounds, tokens = (1, 8) if opts.quick else (ROUNDS, ANSWER_TOKENS)
    async with llama_wsserver(
        model, threads=threads, parallel=1, n_ctx=4096, unpaced=True
    ) as server:
        # Not counted: the model's pages are warm for every way.
        await timed_alone(server.url, _generate([{"role": "user", "content": "Warm up."}], 4))

        async def conversation(way: str, rep: int) -> list[Any]:
            opts.log(f"  five turns, round {rep + 1}, {way}")
            return await _conversation(server, way, f"R{rep}-{way}", tokens)

        raw = await side_by_side(
            rounds, {way: functools.partial(conversation, way) for way in WAYS}
        )
    per_turn = []
    for number in range(len(QUESTIONS)):
        row: dict[str, Any] = {"turn": number + 1}
        for way in WAYS:
            runs = [conversation[number] for conversation in raw[way]]
            row[way] = {
                "ttft_ms": median(r["ttft_ms"] for r in runs),
                "prompt_tokens": runs[0]["prompt_tokens"],
                "cached_tokens": median(r["cached_tokens"] or 0 for r in runs),
            }
        per_turn.append(row)
    return {"rounds": rounds, "answer_tokens": tokens, "turns": per_turn, "raw": raw}


# ------------------------------------------------------------------ 2. the wire's overhead


async def overhead(opts: Options) -> dict[str, Any]:
    import aiohttp
    from websockets.asyncio.client import connect

    tokens, rounds = (300, 3) if opts.quick else (FAKE_TOKENS, FAKE_ROUNDS)
    overrides = {
        "backend.kind": "fake",
        "backend.fake.tokens_per_s": 0,
        "limits.max_tokens": tokens,
        **UNPACED,
    }
    body = {"model": "fake", "input": "p", "max_output_tokens": tokens}
    messages = [{"role": "user", "content": "p"}]
    async with (
        ServerProcess(overrides, name="wsserver-fake-responses") as server,
        aiohttp.ClientSession() as http,
    ):
        # Each wire on one open connection (the HTTP session keeps its own alive).
        ours = await open_connection(server.url)
        socket = await connect(server.url + "v1/responses", max_size=None)
        wires = {
            "ws": lambda: _ws_turn(ours, messages, tokens),
            "ws_mode": lambda: _socket_response(socket, body),
            "http": lambda: _http_response(http, server.http, body),
        }

        async def one(wire: str, rep: int) -> dict[str, Any]:
            # A request meets what the one before it left behind (a 4,000-token
            # stream's tail costs the next request's first token ~0.6 ms on any
            # wire): each measured request follows one of its own wire, so no
            # wire always follows another.
            await wires[wire]()
            turn = await wires[wire]()
            return {"ttft_ms": turn["ttft_ms"], "tok_s": turn["tok_s"]}

        try:
            # Round 0 warms up, not counted.
            runs = await side_by_side(
                rounds + 1, {w: functools.partial(one, w) for w in WIRES}, skip=1
            )
        finally:
            await socket.close()
            await ours.close()
    rows = []
    for wire in WIRES:
        ttft = [r["ttft_ms"] for r in runs[wire]]
        tok_s = [r["tok_s"] for r in runs[wire]]
        row: dict[str, Any] = {
            "wire": wire,
            "ttft_ms": summary(ttft),
            "tok_s": summary(tok_s),
        }
        if wire != "ws":
            ours_ttft = [r["ttft_ms"] for r in runs["ws"]]
            row["added_ttft_ms"] = median(pair_deltas(ttft, ours_ttft))
            row["throughput_ratio"] = median(pair_ratios(tok_s, [r["tok_s"] for r in runs["ws"]]))
        rows.append(row)
    return {"tokens": tokens, "rounds": rounds, "rows": rows}


# ------------------------------------------------------------------ the section


async def run(opts: Options) -> dict[str, Any]:
    result: dict[str, Any] = {"status": "ok"}
    opts.log("  the Responses wire's overhead on the fake engine")
    result["overhead"] = await overhead(opts)
    try:
        model = llama_model(opts)
    except Skip as exc:
        result["five_turns"] = {"skipped": str(exc)}
        return result
    threads = opts.n_threads
    result["threads"] = threads
    result["five_turns"] = await five_turns(opts, model, threads)
    return result


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for row in result["overhead"]["rows"]:
        if row["wire"] == "ws":
            continue
        label = WIRE_LABELS[row["wire"]]
        added, ratio = row.get("added_ttft_ms"), row.get("throughput_ratio")
        out += [
            target(
                f"{label}: added TTFT ≤ 1 ms (fake engine)", added, lambda v: v <= 1.0, "{:,.2f} ms"
            ),
            target(
                f"{label}: throughput ≥ 0.98x our protocol (fake engine)",
                ratio,
                lambda v: v >= 0.98,
                "{:,.3f}x",
            ),
        ]
    return out


def render(result: dict[str, Any]) -> str:
    lines: list[str] = []
    turns = result.get("five_turns") or {}
    if "turns" in turns:
        lines += [
            f"Default model, {result.get('threads')} thread(s), `parallel = 1`, temperature 0, "
            f"{turns['answer_tokens']} tokens per answer, median of {turns['rounds']} round(s). "
            "TTFT in ms at the client (prompt tokens / of them reused from the prefix cache).",
            "",
            "| turn | " + " | ".join(LABELS[w] for w in WAYS) + " |",
            "|---:|" + "---:|" * len(WAYS),
        ]
        for row in turns["turns"]:
            cells = [
                f"{fmt(row[w]['ttft_ms'])} ({row[w]['prompt_tokens']} / "
                f"{fmt(row[w]['cached_tokens'], 0)})"
                for w in WAYS
            ]
            lines.append(f"| {row['turn']} | " + " | ".join(cells) + " |")
        lines.append("")
    else:
        lines += [f"Five turns not measured: {turns.get('skipped', 'no model')}.", ""]
    over = result["overhead"]
    lines += [
        f"Fake engine, unpaced, flushed after every token, {over['tokens']} tokens per stream, "
        "each wire on one open connection, each measured stream after an unmeasured one "
        f"of its own wire; median of {over['rounds']} rounds (ratios per round, then the median).",
        "",
        "| wire | TTFT ms | tok/s | added TTFT ms | throughput vs ours |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in over["rows"]:
        lines.append(
            f"| {WIRE_LABELS[row['wire']]} | {fmt(row['ttft_ms'].get('median'), 2)} | "
            f"{fmt(row['tok_s'].get('median'), 0)} | {fmt(row.get('added_ttft_ms'), 2)} | "
            f"{fmt(row.get('throughput_ratio'), 3, 'x')} |"
        )
    lines.append("")
    for t in targets(result):
        mark = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"- {t['name']}: {t['shown']} — {mark}")
    return "\n".join(lines)


def headlines(result: dict[str, Any]) -> list[str]:
    parts = []
    turns = (result.get("five_turns") or {}).get("turns")
    if turns:
        last = turns[-1]
        parts.append("turn 5 TTFT " + ", ".join(f"{w} {fmt(last[w]['ttft_ms'])} ms" for w in WAYS))
    for row in result["overhead"]["rows"]:
        if row["wire"] != "ws":
            parts.append(
                f"{WIRE_LABELS[row['wire']]} +{fmt(row.get('added_ttft_ms'), 2)} ms TTFT, "
                f"{fmt(row.get('throughput_ratio'), 3, 'x')} throughput (fake)"
            )
    return ["| the Responses API (section 13) | " + "; ".join(parts) + " |"]

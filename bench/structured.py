"""Section 12: the sampler chain and structured output (issue 22) — what they cost.

Default model, one run, contenders alternating at every point so drift on
this noisy machine hits all alike:

* **The default chain costs nothing:** aggregate decode tokens/s (completion
  tokens / (last delta - first send), as section 10 counts) at 1 and 8
  concurrent streams of 128 tokens, temperature 0, no new option in the
  requests — this checkout against wsserver as of ``--baseline REF`` (its tree
  exported with ``git archive``, its server run from there, beside this one;
  both hold the model, only one generates at a time). Each round sends both
  the same prompts (a round's own tag, so no round reuses another's cached
  prefix), the order flipping every round; the ratio is taken per round, then
  the median. Without ``--baseline`` only this checkout is measured.
* **JSON-schema generation against llama-server:** the same object schema
  (typed properties, required fields, an enum, an array), the same raw prompt
  and the same sampler settings (llama-server's defaults: top_k 40, top_p
  0.95, min_p 0.05) at temperature 1, one seed per answer: wsserver's
  WebSocket ``generate`` with ``json_schema`` (``parallel = 1``) against
  llama-server's streamed ``/completion`` with ``json_schema`` (``-np 1``,
  from ``scripts/llama-tools``), alternating per seed. Decode rate = text
  tokens after the first / (last token's arrival - first's), summed over all
  answers; llama-server's ``tokens_predicted`` counts the end-of-generation
  token, which carries no text, so it is taken off (wsserver does not count
  it). Every answer is parsed and validated with ``jsonschema``. Without the
  tools (and always in quick mode) the llama-server column is "not measured".
* **One constrained stream in a batch of 8** (``parallel = 8``): seven
  unconstrained streams (temperature 0, 128 tokens) beside an eighth that
  keeps its slot busy — it re-sends its request (temperature 1, seeded) as
  soon as one ends, and is cancelled when the seven are done. With the schema
  its answers end with the document (up to 192 tokens); without it, each is
  cut at the length of one of part 2's schema answers in turn, so both
  variants bring the same churn of short requests (admission, prefix reuse,
  the batch's change of shape — which slows the others' steps by itself, see
  docs/llama.md) and only the grammar differs. The seven's aggregate rate with
  the schema over without, per round (order flipping), median.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from .batched import N_CTX, _wait_health, _ws_server, _ws_stream, prompts, tools_dir
from .common import ROOT, ServerProcess, Skip, free_port, ratio
from .lineup import _default_model, export_tree
from .options import Options
from .structured_report import SCHEMA, render, summary_line, targets

__all__ = ["SCHEMA", "render", "run", "summary_line", "targets"]

STREAMS = (1, 8)
TOKENS = 128
ROUNDS = 4
SEEDS = 16
#: Room for the longest document the schema allows (every string is bounded).
JSON_TOKENS = 192
JSON_PROMPT = "Here is one employee record from the company directory, as JSON:\n"
#: llama-server's defaults, sent to both so the chains match.
CHAIN = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


async def _warm(url: str, n: int, **schema: Any) -> None:
    """``n`` short requests at once, not counted: the model's pages, every slot
    and a batch of ``n`` are warm before the first measured run (with
    ``json_schema``, one of them compiles the grammar into the server's cache)."""
    t0 = time.perf_counter()
    await asyncio.gather(
        *(
            _ws_stream(url, f"warm{i}", f"Warm up {i}.", 8, t0, **(schema if i == 0 else {}))
            for i in range(n)
        )
    )


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.Draft202012Validator(SCHEMA).validate(json.loads(text))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ------------------------------------------------------------------ 1. default chain


async def _aggregate(server: ServerProcess, texts: list[str], tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs = await asyncio.gather(
        *(_ws_stream(server.url, f"s{i}", p, tokens, t0) for i, p in enumerate(texts))
    )
    count = sum(r["done"]["usage"]["completion_tokens"] for r in runs)
    end = max(r["arrivals"][-1] if r["arrivals"] else r["sent"] for r in runs)
    return {"tok_s": count / end, "tokens": count, "texts": [r["text"] for r in runs]}


async def default_chain(
    opts: Options, model: str, threads: int, baseline: Path | None
) -> list[dict[str, Any]]:
    tokens, rounds = (24, 1) if opts.quick else (TOKENS, ROUNDS)
    rows = []
    for n in STREAMS:
        opts.log(f"  default chain, {n} stream(s)")
        trees = {"this": ROOT, **({"baseline": baseline} if baseline is not None else {})}
        servers: dict[str, ServerProcess] = {}
        try:
            for label, root in trees.items():
                servers[label] = await _ws_server(
                    model, threads, n, root=root, name=f"wsserver-{label}"
                ).start(timeout=300)
                await _warm(servers[label].url, n)
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
            for rep in range(rounds):
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))
                for label in order:
                    texts = prompts(n, f"Round {rep}")
                    runs[label].append(await _aggregate(servers[label], texts, tokens))
        finally:
            for server in servers.values():
                await server.stop()
        row: dict[str, Any] = {"streams": n, "rounds": rounds, "tokens": tokens}
        for label, got in runs.items():
            row[label] = {
                "tok_s": statistics.median(r["tok_s"] for r in got),
                "runs": [round(r["tok_s"], 2) for r in got],
            }
        if "baseline" in runs:
            pairs = zip(runs["this"], runs["baseline"], strict=True)
            paired = [(a, b) for a, b in pairs]
            row["ratio"] = statistics.median(a["tok_s"] / b["tok_s"] for a, b in paired)
            row["identical_texts"] = sum(a["texts"] == b["texts"] for a, b in paired)
        rows.append(row)
    return rows


# ------------------------------------------------------------------ 2. vs llama-server


async def _llama_server_json(port: int, seed: int, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    body = {
        "prompt": JSON_PROMPT,
        "n_predict": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "json_schema": SCHEMA,
        "stream": True,
        **CHAIN,
    }
    parts: list[str] = []
    arrivals: list[float] = []
    final: dict[str, Any] = {}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/completion", json=body) as resp,
    ):
        t0 = time.perf_counter()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if data.get("content"):
                arrivals.append(time.perf_counter() - t0)
                parts.append(data["content"])
            if data.get("stop"):
                final = data
    end = time.perf_counter() - t0
    tokens = int(final.get("tokens_predicted") or 0)
    ended = "stop" if final.get("stop_type") == "eos" else "length"
    if ended == "stop":
        tokens -= 1  # the end-of-generation token: sampled and counted, no text
    text = "".join(parts)
    return _answer(text, tokens, arrivals, end, ended, events=len(arrivals))


async def _wsserver_json(url: str, seed: int, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    run = await _ws_stream(
        url, f"j{seed}", JSON_PROMPT, max_tokens, t0,
        temperature=1.0, seed=seed, json_schema=SCHEMA, **CHAIN,
    )  # fmt: skip
    end = time.perf_counter() - t0
    arrivals = [a - run["sent"] for a in run["arrivals"]]
    done = run["done"]
    tokens = done["usage"]["completion_tokens"]
    return _answer(run["text"], tokens, arrivals, end - run["sent"], done["reason"])


def _answer(
    text: str, tokens: int, arrivals: list[float], end: float, ended: str, **extra: Any
) -> dict[str, Any]:
    """One answer: its tokens, its timing (seconds from the send) and whether it validates."""
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return {
        "tokens": tokens,
        "decode_s": span,
        "total_s": end,
        "ended": ended,
        "valid": _valid(text),
        "chars": len(text),
        **extra,
    }


def _totals(answers: list[dict[str, Any]]) -> dict[str, Any]:
    decode_s = sum(a["decode_s"] for a in answers if a["decode_s"] > 0)
    decoded = sum(a["tokens"] - 1 for a in answers if a["decode_s"] > 0)
    return {
        "answers": len(answers),
        "valid": sum(a["valid"] for a in answers),
        "finished": sum(a["ended"] == "stop" for a in answers),
        "finished_valid": sum(a["valid"] for a in answers if a["ended"] == "stop"),
        "tokens": sum(a["tokens"] for a in answers),
        "decode_tok_s": decoded / decode_s if decode_s else None,
        "total_tok_s": sum(a["tokens"] for a in answers) / sum(a["total_s"] for a in answers),
    }


async def _start_llama_server(tools: Path, model: str, threads: int) -> tuple[Any, int]:
    port = free_port()
    args = [str(tools / "llama-server"), "-m", model, "-np", "1", "-c", str(N_CTX)]
    args += ["-t", str(threads), "-fa", "off", "--port", str(port), "--host", "127.0.0.1"]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        await _wait_health(port)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, port


async def schema_vs_llama_server(
    opts: Options, model: str, threads: int, tools: Path | None
) -> dict[str, Any]:
    seeds, max_tokens = (2, 48) if opts.quick else (SEEDS, JSON_TOKENS)
    server = await _ws_server(model, threads, 1).start(timeout=300)
    peer = None
    answers: dict[str, list[dict[str, Any]]] = {"wsserver": []}
    try:
        if tools is not None:
            peer, port = await _start_llama_server(tools, model, threads)
            answers["llama-server"] = []
        # A warm-up answer each, not counted: the model's pages and the
        # grammar machinery are warm for both.
        await _wsserver_json(server.url, 10_000, 8)
        if peer is not None:
            await _llama_server_json(port, 10_000, 8)
        for seed in range(seeds):
            order = list(answers) if seed % 2 == 0 else list(reversed(answers))
            for name in order:
                if name == "wsserver":
                    answers[name].append(await _wsserver_json(server.url, seed, max_tokens))
                else:
                    answers[name].append(await _llama_server_json(port, seed, max_tokens))
    finally:
        await server.stop()
        if peer is not None:
            peer.terminate()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(peer.wait(), 30)
    out: dict[str, Any] = {"seeds": seeds, "max_tokens": max_tokens, "chain": CHAIN}
    for name, got in answers.items():
        out[name] = {**_totals(got), "raw": got}
    if "llama-server" in out:
        out["ratio"] = ratio(out["wsserver"]["decode_tok_s"], out["llama-server"]["decode_tok_s"])
    return out


# ------------------------------------------------------------------ 3. one constrained in 8


async def _batch_of_eight(
    url: str,
    texts: list[str],
    tokens: int,
    seed: int,
    constrained: bool,
    eighth_tokens: int,
    lengths: list[int],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    finished = asyncio.Event()
    extra: dict[str, Any] = {"temperature": 1.0, "seed": seed, **CHAIN}
    if constrained:
        extra["json_schema"] = SCHEMA

    async def eighth() -> list[dict[str, Any]]:
        ends = []
        while not finished.is_set():
            # Unconstrained, the eighth's answers are as long as the schema's
            # (their lengths, in turn): the same churn of requests, only the
            # grammar differs.
            limit = eighth_tokens if constrained else lengths[len(ends) % len(lengths)]
            run = await _ws_stream(
                url, f"e{len(ends)}", JSON_PROMPT, limit, t0, stop_on=finished, **extra
            )
            ends.append({"reason": run["done"]["reason"], "valid": _valid(run["text"])})
        return ends

    keeper = asyncio.create_task(eighth())
    try:
        seven = await asyncio.gather(
            *(_ws_stream(url, f"s{i}", p, tokens, t0) for i, p in enumerate(texts))
        )
    finally:
        finished.set()
    ends = await keeper
    count = sum(r["done"]["usage"]["completion_tokens"] for r in seven)
    end = max(r["arrivals"][-1] if r["arrivals"] else r["sent"] for r in seven)
    done = [e for e in ends if e["reason"] != "cancelled"]
    return {
        "tok_s": count / end,
        "tokens": count,
        "texts": [r["text"] for r in seven],
        "eighth_answers": len(done),
        "eighth_valid": sum(e["valid"] for e in done if e["reason"] == "stop"),
        "eighth_finished": sum(e["reason"] == "stop" for e in done),
    }


async def one_constrained(
    opts: Options, model: str, threads: int, lengths: list[int]
) -> dict[str, Any]:
    """``lengths``: the tokens of part 2's constrained answers, which the
    unconstrained eighth's answers take in turn as their ``max_tokens``."""
    tokens, rounds = (24, 1) if opts.quick else (TOKENS, ROUNDS)
    # The eighth has room for a whole document, as in part 2.
    eighth_tokens = 48 if opts.quick else JSON_TOKENS
    server = await _ws_server(model, threads, 8).start(timeout=300)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    try:
        await _warm(server.url, 8, json_schema=SCHEMA)
        for rep in range(rounds):
            texts = prompts(7, f"Batch {rep}")
            for constrained in (False, True) if rep % 2 == 0 else (True, False):
                got = await _batch_of_eight(
                    server.url, texts, tokens, rep, constrained, eighth_tokens, lengths
                )
                runs[constrained].append(got)
    finally:
        await server.stop()
    pairs = list(zip(runs[False], runs[True], strict=True))
    return {
        "rounds": rounds,
        "tokens": tokens,
        "eighth_lengths": lengths,
        "free_tok_s": statistics.median(r["tok_s"] for r in runs[False]),
        "constrained_tok_s": statistics.median(r["tok_s"] for r in runs[True]),
        "ratio": statistics.median(b["tok_s"] / a["tok_s"] for a, b in pairs),
        "identical_texts": sum(a["texts"] == b["texts"] for a, b in pairs),
        "eighth": {
            str(flag).lower(): {
                key: sum(r[key] for r in got)
                for key in ("eighth_answers", "eighth_finished", "eighth_valid")
            }
            for flag, got in runs.items()
        },
        "runs": {
            str(flag).lower(): [round(r["tok_s"], 2) for r in got] for flag, got in runs.items()
        },
    }


# ------------------------------------------------------------------ the section


async def run(opts: Options) -> dict[str, Any]:
    try:
        import jsonschema  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise Skip(f"{exc.name} is not installed ({exc})") from None
    model = opts.model or _default_model()
    threads = opts.threads or os.cpu_count() or 1
    result: dict[str, Any] = {"status": "ok", "threads": threads, "baseline": opts.baseline}
    baseline = export_tree(opts.baseline) if opts.baseline else None
    try:
        result["default_chain"] = await default_chain(opts, model, threads, baseline)
    finally:
        if baseline is not None:
            shutil.rmtree(baseline, ignore_errors=True)
    # Never a build in quick mode (or in the test suite): ~15 minutes on 2 cores.
    tools = None if opts.quick else await asyncio.to_thread(tools_dir)
    opts.log(f"  JSON schema against llama-server ({tools or 'tools not available'})")
    result["json_schema"] = await schema_vs_llama_server(opts, model, threads, tools)
    opts.log("  one constrained stream in a batch of 8")
    lengths = [max(1, a["tokens"]) for a in result["json_schema"]["wsserver"]["raw"]]
    result["batch"] = await one_constrained(opts, model, threads, lengths)
    return result

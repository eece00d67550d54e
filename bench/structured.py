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
import functools
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

from .common import ROOT, Skip
from .contenders import llama_completion
from .lineup import distinct, export_tree
from .options import Options
from .servers import ServerProcess, llama_model, llama_server, llama_wsserver, running, tools_for
from .structured_report import SCHEMA, headlines, render, targets
from .timing import aggregate, now, ratio, side_by_side
from .wsload import at_once, generate_frame, timed_alone

__all__ = ["SCHEMA", "headlines", "render", "run", "targets"]

STREAMS = (1, 8)
TOKENS = 128
ROUNDS = 4
SEEDS = 16
#: Per sequence: a short prompt and its answer fit (section 10's context).
N_CTX = 1024
#: Room for the longest document the schema allows (every string is bounded).
JSON_TOKENS = 192
JSON_PROMPT = "Here is one employee record from the company directory, as JSON:\n"
#: llama-server's defaults, sent to both so the chains match.
CHAIN = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


def _server(model: str, threads: int, parallel: int, **kw: Any) -> ServerProcess:
    return llama_wsserver(
        model, threads=threads, parallel=parallel, n_ctx=N_CTX, unpaced=True, **kw
    )


async def _warm(url: str, n: int, **schema: Any) -> None:
    """``n`` short requests at once, not counted: the model's pages, every slot
    and a batch of ``n`` are warm before the first measured run (with
    ``json_schema``, one of them compiles the grammar into the server's cache)."""
    await asyncio.gather(
        *(
            timed_alone(
                url, generate_frame(f"warm{i}", f"Warm up {i}.", 8, **(schema if i == 0 else {}))
            )
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


async def _chain_at(
    model: str, threads: int, trees: dict[str, Path], n: int, tokens: int, rounds: int
) -> dict[str, Any]:
    """``n`` streams at once on each tree's server, side by side; its row."""
    ours = {
        label: _server(model, threads, n, root=root, name=f"wsserver-{label}")
        for label, root in trees.items()
    }
    async with running(ours) as servers:

        async def measure(label: str, rep: int) -> dict[str, Any]:
            runs, t0 = await at_once(servers[label].url, distinct(n, f"Round {rep}"), tokens)
            return {**aggregate(runs, t0), "texts": [r.text for r in runs]}

        for server in servers.values():
            await _warm(server.url, n)
        contenders = {label: functools.partial(measure, label) for label in servers}
        runs = await side_by_side(rounds, contenders, order="flip")
    row: dict[str, Any] = {"streams": n, "rounds": rounds, "tokens": tokens}
    for label, got in runs.items():
        row[label] = {
            "tok_s": statistics.median(r["tok_s"] for r in got),
            "runs": [round(r["tok_s"], 2) for r in got],
        }
    if "baseline" in runs:
        paired = list(zip(runs["this"], runs["baseline"], strict=True))
        row["ratio"] = statistics.median(a["tok_s"] / b["tok_s"] for a, b in paired)
        row["identical_texts"] = sum(a["texts"] == b["texts"] for a, b in paired)
    return row


async def default_chain(
    opts: Options, model: str, threads: int, baseline: Path | None
) -> list[dict[str, Any]]:
    tokens, rounds = (24, 1) if opts.quick else (TOKENS, ROUNDS)
    trees = {"this": ROOT, **({"baseline": baseline} if baseline is not None else {})}
    rows = []
    for n in STREAMS:
        opts.log(f"  default chain, {n} stream(s)")
        rows.append(await _chain_at(model, threads, trees, n, tokens, rounds))
    return rows


# ------------------------------------------------------------------ 2. vs llama-server


async def _llama_server_json(port: int, seed: int, max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": JSON_PROMPT,
        "n_predict": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "json_schema": SCHEMA,
        **CHAIN,
    }
    run = await llama_completion(port, body)
    assert run.head is not None
    # Timed from the response's head, as llama-server's answers always were here.
    arrivals = [a - run.head for a in run.arrivals or []]
    tokens = run.tokens
    ended = "stop" if run.final.get("stop_type") == "eos" else "length"
    if ended == "stop":
        tokens -= 1  # the end-of-generation token: sampled and counted, no text
    end = (run.end or run.head) - run.head
    return _answer(run.text, tokens, arrivals, end, ended, events=len(arrivals))


async def _wsserver_json(url: str, seed: int, max_tokens: int) -> dict[str, Any]:
    extra = {"temperature": 1.0, "seed": seed, "json_schema": SCHEMA, **CHAIN}
    frame = generate_frame(f"j{seed}", JSON_PROMPT, max_tokens, **extra)
    run = await timed_alone(url, frame, arrivals=True)
    end = now() - run.sent
    arrivals = [a - run.sent for a in run.arrivals or []]
    return _answer(run.text, run.tokens, arrivals, end, run.final["reason"])


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


async def schema_vs_llama_server(
    opts: Options, model: str, threads: int, tools: Path | None
) -> dict[str, Any]:
    seeds, max_tokens = (2, 48) if opts.quick else (SEEDS, JSON_TOKENS)
    async with _server(model, threads, 1) as server:
        contenders = {"wsserver": functools.partial(_wsserver_json, server.url)}
        peer = None
        if tools is not None:
            args = ("-np", 1, "-c", N_CTX, "-t", threads, "-fa", "off")
            peer = await llama_server(tools / "llama-server", model, *args).start()
            contenders["llama-server"] = functools.partial(_llama_server_json, peer.port)
        try:
            # A warm-up answer each, not counted: the model's pages and the
            # grammar machinery are warm for both.
            for answer in contenders.values():
                await answer(10_000, 8)
            answers = await side_by_side(
                seeds,
                {
                    name: functools.partial(a, max_tokens=max_tokens)
                    for name, a in contenders.items()
                },
                order="flip",
            )
        finally:
            if peer is not None:
                await peer.stop()
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
    finished = asyncio.Event()
    extra: dict[str, Any] = {"temperature": 1.0, "seed": seed, **CHAIN}
    if constrained:
        extra["json_schema"] = SCHEMA

    async def eighth() -> list[dict[str, Any]]:
        ends: list[dict[str, Any]] = []
        while not finished.is_set():
            # Unconstrained, the eighth's answers are as long as the schema's
            # (their lengths, in turn): the same churn of requests, only the
            # grammar differs.
            limit = eighth_tokens if constrained else lengths[len(ends) % len(lengths)]
            frame = generate_frame(f"e{len(ends)}", JSON_PROMPT, limit, **extra)
            run = await timed_alone(url, frame, cancel_on=finished)
            ends.append({"reason": run.final["reason"], "valid": _valid(run.text)})
        return ends

    keeper = asyncio.create_task(eighth())
    try:
        seven, t0 = await at_once(url, texts, tokens)
    finally:
        finished.set()
    ends = await keeper
    done = [e for e in ends if e["reason"] != "cancelled"]
    return {
        **aggregate(seven, t0),
        "texts": [r.text for r in seven],
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
    async with _server(model, threads, 8) as server:
        await _warm(server.url, 8, json_schema=SCHEMA)

        def batch(constrained: bool) -> Any:
            return lambda rep: _batch_of_eight(
                server.url,
                distinct(7, f"Batch {rep}"),
                tokens,
                rep,
                constrained,
                eighth_tokens,
                lengths,
            )

        runs = await side_by_side(rounds, {False: batch(False), True: batch(True)}, order="flip")
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
    except ImportError as exc:
        raise Skip(f"{exc.name} is not installed ({exc})") from None
    model = llama_model(opts)
    threads = opts.n_threads
    result: dict[str, Any] = {"status": "ok", "threads": threads, "baseline": opts.baseline}
    baseline = export_tree(opts.baseline) if opts.baseline else None
    try:
        result["default_chain"] = await default_chain(opts, model, threads, baseline)
    finally:
        if baseline is not None:
            shutil.rmtree(baseline, ignore_errors=True)
    tools = await tools_for(opts)
    opts.log("  JSON schema against llama-server")
    result["json_schema"] = await schema_vs_llama_server(opts, model, threads, tools)
    opts.log("  one constrained stream in a batch of 8")
    lengths = [max(1, a["tokens"]) for a in result["json_schema"]["wsserver"]["raw"]]
    result["batch"] = await one_constrained(opts, model, threads, lengths)
    return result

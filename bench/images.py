"""Section 20: an image goes in — its encode, its first token, and the streams beside it (issue 39).

    python -m bench.images [--rounds 3] [--sizes tiny small] [--threads 2] [--out /tmp/images.md]

No real vision weights can be downloaded here, so both contenders serve a
pair built with the tests' builders (``tests/tiny_gguf.py``,
``tests/tiny_mmproj.py``, parametrised; written into a temporary folder): a
random-weight llama text model and a LLaVA-style ``mlp`` projector whose
output width is the text model's. Two sizes (:data:`PAIRS`):

* **tiny** — the tests' pair: 32-pixel images, patches of 8 → 16 image
  tokens, 2 vision layers of width 32; the text model 2 layers of width 64.
  Its encode takes about a millisecond: it shows the plumbing's overhead.
* **small** — 224-pixel images, patches of 14 → 256 image tokens (CLIP
  ViT-B/14's grid), 7 vision layers (the llava graph runs 6) of width 256,
  4 heads, feed-forward 1024; the text model 4 layers of width 256,
  feed-forward 768. Less than half LLaVA 1.5's 576 image tokens and a
  sliver of its CLIP ViT-L/14's work, but its encode (~2 GFLOP) and its 256
  embeddings' decode should cost tens of milliseconds on two cores: enough
  that a server which does both in one step shows it in the streams' gaps.

Both text models carry one ChatML template, so that the two servers render
the same prompt (each one's fallback for a model without one differs).
llama-server still counts one token more: it adds the vocabulary's BOS to a
template's prompt (``add_bos_token`` is true here), where wsserver leaves
the BOS to the template, which writes none (checked: a text-only message,
an image alone, text and an image each differ by exactly one; the image's
16 tokens are the same on both).

Contenders, one server at a time, alternating round by round (the order
flips each round): wsserver at its defaults (the freeze bound
``prefill_gap_ms = 200``; the pair as ``backend.llama.model`` and
``backend.llama.mmproj``; 4 slots; each token its own SSE event) and
``llama-server -np 4 --mmproj`` (``scripts/llama-tools`` builds it; its
defaults otherwise, ``-lv 4`` so that its log times the image's encode and
its embeddings' decode; without it its rows read "not measured"). The same
threads for both (``--threads``, default 2), temperature 0. Per round:

* **alone** — an image request (``POST /v1/chat/completions``, SSE, a
  ``data:`` URL of a 256 x 256 PNG, a different image each time, 8 tokens;
  ``cache_prompt: false`` for llama-server, whose prompt cache would skip a
  repeated image) a few times (``ALONE``): its **time to first token**, the
  server's own **encode** time and the embeddings' **decode** time (wsserver:
  ``bench.probe_server`` times the engine's ``ImageDecoder.encode`` and
  ``decode`` calls; llama-server: its log lines ``encoding mtmd batch`` →
  ``decoding image batch 1/n`` and ``image decoded (batch i/n) in N ms``);
* **beside** — three greedy streams (``POST /v1/completions``, SSE) decode;
  once each has had ``DELTAS_BEFORE`` pieces, an image request arrives: the
  streams' median gap before it (once all three decode), their **worst gap**
  from its send to its first token, and its time to first token.

On these text models a decode step takes a millisecond or two, faster than
the client reads three streams at times: pieces then arrive in bursts, and
the median gap "before" is the client's reading as much as the server's
steps. The worst gap is the figure that matters (an image's encode and its
embeddings' decode against a step of milliseconds), and the image's time to
first token. Each image is drawn before a measure starts (~0.1 s of the
harness's own loop), never during one.

The medians of the rounds are reported. Targets: the streams' worst gap at
most 250 ms with an image arriving (issue 40's freeze bound, as in section
15), and the image's first token beside llama-server's, as a ratio (the
issue sets no bound on it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import Skip
from .figures import TIMES, fmt, target, target_rows
from .freeze import STEADY_AFTER
from .freeze import _summary as gaps_summary
from .image_servers import (
    LLAMA_SERVER,
    PAIRS,
    WSSERVER,
    Contender,
    LlamaServer,
    Wsserver,
    image_url,
    write_pair,
)
from .lineup import distinct
from .options import Options
from .servers import llama_server_binary, require_llama
from .timing import Stream, median, ratio

#: Deltas each stream gets before the image is sent (see bench/freeze.py).
DELTAS_BEFORE = STEADY_AFTER + 20
#: Image requests alone per round.
ALONE = 3
#: The three streams ask for this many tokens (they are stopped once the image's first arrives).
STREAM_TOKENS = 3500
#: Issue 40's bound on the others' worst gap (section 15's).
WORST_GAP_MS = 250.0


@dataclass
class Plan:
    sizes: tuple[str, ...]
    rounds: int
    alone: int
    threads: int
    stream_tokens: int = STREAM_TOKENS
    log: Callable[[str], None] = print


# ------------------------------------------------------------------ the measures


def _after(n: int, event: asyncio.Event) -> Callable[[Stream], Awaitable[None]]:
    async def count(stream: Stream) -> None:
        if stream.pieces == n:
            event.set()

    return count


async def alone(server: Contender, first: int, n: int) -> dict[str, Any]:
    """``n`` image requests one after another: TTFT, encode and decode, medians."""
    ttft, encode, decode, prompt = [], [], [], []
    for i in range(n):
        image_url(first + i)
        run = await server.image(first + i)
        work = await server.image_work()
        ttft.append(run.ttft_ms)
        prompt.append((run.final.get("usage") or {}).get("prompt_tokens"))
        if len(work) == 1:
            encode.append(work[0]["encode_ms"])
            decode.append(work[0]["decode_ms"])
    return {
        "alone_ttft_ms": median(ttft),
        "encode_ms": median(encode),
        "embd_decode_ms": median(decode),
        "prompt_tokens": median(prompt),
    }


async def beside(server: Contender, index: int, stream_tokens: int) -> dict[str, Any]:
    """Three streams decoding, then an image: their gaps and its TTFT (bench/freeze.py's)."""
    done = asyncio.Event()
    ready = [asyncio.Event() for _ in range(3)]

    async def decode(prompt: str, ready: asyncio.Event) -> Stream:
        try:
            return await server.text(prompt, stream_tokens, done, _after(DELTAS_BEFORE, ready))
        finally:
            ready.set()  # also a stream that ended early: the image still goes

    streams = [
        asyncio.create_task(decode(p, ready[i]))
        for i, p in enumerate(distinct(3, f"images {index}"))
    ]
    image_url(index)
    for event in ready:
        await event.wait()
    image = await server.image(index)
    done.set()
    runs = await asyncio.gather(*streams)
    await server.image_work()
    assert image.first is not None
    others = [r.arrivals or [] for r in runs]
    tokens = int((image.final.get("usage") or {}).get("prompt_tokens") or 0)
    row = gaps_summary(others, image.sent, image.first, tokens)
    # A stream that ended by itself during the wait (its tokens spent) hides the rest of it.
    row["streams_outlasted"] = all(r.final.get("stopped") for r in runs)
    return {
        "gap_median_ms": row["gap_median_ms"],
        "gap_worst_ms": row["gap_worst_ms"],
        "worst_over_median": row["worst_over_median"],
        "beside_ttft_ms": row["ttft_ms"],
        "others_tokens": row["others_tokens"],
        "streams_outlasted": row["streams_outlasted"],
    }


async def _round(server: Contender, plan: Plan, round_: int) -> dict[str, Any]:
    async with server.serving():
        await server.text("Warm up.", 8)
        await server.image(10_000 + round_)  # the first image: the encoder's buffers
        await server.image_work()
        row = await alone(server, 100 * round_, plan.alone)
        row.update(await beside(server, 100 * round_ + 50, plan.stream_tokens))
    return row


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in rounds[0]:
        if key == "streams_outlasted":
            out[key] = all(r[key] for r in rounds)
        else:
            out[key] = median(r.get(key) for r in rounds)
    return out


async def measure(plan: Plan) -> dict[str, Any]:
    try:
        binary: Path | None = llama_server_binary()
    except Skip as exc:
        plan.log(f"  llama-server: not measured ({exc})")
        binary = None
    rows = []
    for size in plan.sizes:
        pair = PAIRS[size]
        with tempfile.TemporaryDirectory(prefix=f"bench-images-{size}-") as folder:
            text, projector = write_pair(pair, Path(folder))
            contenders: list[Contender] = [Wsserver(text, projector, plan.threads)]
            if binary is not None:
                contenders.append(LlamaServer(binary, text, projector, plan.threads))
            rounds: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
            for r in range(plan.rounds):
                for server in contenders if r % 2 == 0 else contenders[::-1]:
                    plan.log(f"  {size} pair, round {r + 1}: {server.name}")
                    rounds[server.name].append(await _round(server, plan, r))
        for name, measured in rounds.items():
            rows.append({"size": size, "contender": name, **_median(measured)})
    return {
        "status": "ok",
        "threads": plan.threads,
        "rounds": plan.rounds,
        "alone": plan.alone,
        "pairs": {size: PAIRS[size].describe() for size in plan.sizes},
        "image_tokens": {size: PAIRS[size].image_tokens for size in plan.sizes},
        "llama_server": "" if binary is None else str(binary),
        "rows": rows,
    }


async def run(opts: Options) -> dict[str, Any]:
    require_llama()
    plan = Plan(
        sizes=("tiny",) if opts.quick else tuple(PAIRS),
        rounds=1 if opts.quick else (opts.repeats or 3),
        alone=1 if opts.quick else ALONE,
        threads=opts.threads or 2,
        log=opts.log,
    )
    return await measure(plan)


# ------------------------------------------------------------------ the report


def _row(result: dict[str, Any], size: str, contender: str) -> dict[str, Any]:
    return next(
        (r for r in result["rows"] if r["size"] == size and r["contender"] == contender), {}
    )


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per pair: the three streams' worst gap with an image arriving at most
    250 ms; the image's first token beside llama-server's (a ratio, no bound)."""
    out = []
    for size in result["pairs"]:
        ours, theirs = _row(result, size, WSSERVER), _row(result, size, LLAMA_SERVER)
        out.append(
            target(
                f"images ({size} pair): three streams' worst gap <= {WORST_GAP_MS:g} ms "
                "with an image arriving",
                ours.get("gap_worst_ms"),
                lambda v: v <= WORST_GAP_MS,
                "{:,.0f} ms",
                missing="not measured",
            )
        )
        value = ratio(ours.get("alone_ttft_ms"), theirs.get("alone_ttft_ms"))
        out.append(
            {
                "name": f"images ({size} pair): an image's TTFT vs llama-server's (no bound set)",
                "value": value,
                "shown": "not measured" if value is None else f"{value:,.2f}{TIMES}",
                "met": None,
            }
        )
    return out


def headlines(result: dict[str, Any]) -> list[str]:
    out = []
    for size in result["pairs"]:
        ours, theirs = _row(result, size, WSSERVER), _row(result, size, LLAMA_SERVER)
        out.append(
            f"| an image ({size} pair, {result['image_tokens'][size]} tokens): first token; "
            "three streams' worst gap beside it | "
            f"wsserver {fmt(ours.get('alone_ttft_ms'), 0)} ms, worst gap "
            f"{fmt(ours.get('gap_worst_ms'), 0)} ms; llama-server "
            f"{fmt(theirs.get('alone_ttft_ms'), 0)} ms, {fmt(theirs.get('gap_worst_ms'), 0)} ms |"
        )
    return out


def notes(result: dict[str, Any]) -> list[str]:
    out = []
    short = [r for r in result["rows"] if r.get("streams_outlasted") is False]
    if short:
        names = ", ".join(f"{r['contender']} ({r['size']})" for r in short)
        out.append(
            f"In {names} a stream spent its tokens and ended by itself while the image went "
            "in: the worst gap covers only the part of the wait the streams saw (raise "
            "`--stream-tokens`)."
        )
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Random-weight pairs ({'; '.join(f'**{k}**: {v}' for k, v in result['pairs'].items())}), "
        f"{result['threads']} thread(s), temperature 0, 256 x 256 PNGs as `data:` URLs over "
        f"`/v1/chat/completions` (SSE). **Alone**: {result['alone']} image request(s) a round, "
        "the time to first token and the server's own encode and embeddings' decode times. "
        "**Beside**: three streams decode (`/v1/completions`, one token per event), then an "
        "image arrives: their median gap before it, their worst gap until its first token, "
        f"and its first token. Medians of {result['rounds']} alternating round(s).",
        "",
        "| pair | contender | prompt tokens | alone: TTFT, ms | encode, ms | embeddings' decode, ms "
        "| TTFT vs llama-server | beside: median gap, ms | worst gap, ms | worst / median "
        "| image's TTFT, ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        peer = _row(result, r["size"], LLAMA_SERVER)
        lines.append(
            f"| {r['size']} | {r['contender']} | {fmt(r.get('prompt_tokens'), 0)} | "
            f"{fmt(r.get('alone_ttft_ms'))} | {fmt(r.get('encode_ms'))} | "
            f"{fmt(r.get('embd_decode_ms'))} | "
            f"{fmt(ratio(r.get('alone_ttft_ms'), peer.get('alone_ttft_ms')), 2, TIMES)} | "
            f"{fmt(r.get('gap_median_ms'))} | {fmt(r.get('gap_worst_ms'))} | "
            f"{fmt(r.get('worst_over_median'), 1, TIMES)} | {fmt(r.get('beside_ttft_ms'))} |"
        )
    if not result.get("llama_server"):
        lines += ["", "llama-server: not measured (not built: run `scripts/llama-tools` once)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--alone", type=int, default=ALONE, help="image requests alone a round")
    parser.add_argument(
        "--stream-tokens", type=int, default=STREAM_TOKENS, help="tokens each stream asks for"
    )
    parser.add_argument("--out", type=Path, help="also write the table and targets here (Markdown)")
    args = parser.parse_args(argv)
    require_llama()
    plan = Plan(
        sizes=tuple(args.sizes),
        rounds=args.rounds,
        alone=args.alone,
        threads=args.threads,
        stream_tokens=args.stream_tokens,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    result = asyncio.run(measure(plan))
    text = "\n".join(
        [
            render(result),
            "",
            "| target | result | met |",
            "|---|---|:-:|",
            *target_rows(targets(result)),
            "",
            *notes(result),
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

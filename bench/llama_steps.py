"""Where a batched step's time goes: decode-only, prompt-only and mixed steps.

    .venv/bin/python bench/llama_steps.py                  # the default model, 2 threads
    .venv/bin/python bench/llama_steps.py --flash-attn on --threads 2

Drives one llama.cpp context of four sequences directly (wsserver's own
``new_context``, no server, no sampling) and times ``llama_decode``:

* **D**: the next token of three decoding sequences alone;
* **P**: a chunk of prompt tokens of a fourth sequence alone, its earlier
  cells already filled up to a position;
* **M**: both in one batch, as the engine's mixed step (llama.cpp splits it
  into two micro-batches: one KV stream per sequence).

per prompt position (0 to 2,900) and chunk size; the minimum of five
repeats each (the machine's noise only ever adds). Prints a Markdown table:
what the prefill budget (``wsserver/backends/llama_budget.py``) has to
follow. Independent of the benchmark harness in bench/; run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp
from llama_cpp._internals import LlamaModel

from wsserver.backends.llama_context import Batch, model_params, new_context
from wsserver.backends.llama_files import default_model_path as _default_model_path

POSITIONS = (0, 1000, 2000, 2900)
CHUNKS = (16, 32, 64, 128, 256)
REPEATS = 5
TOKEN = 1000  # any ordinary token id: the timing does not depend on it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", choices=("on", "off"), default="off")
    args = parser.parse_args()
    path = args.model or str(_default_model_path())
    params = model_params(n_gpu_layers=0, use_mmap=True, use_mlock=False)
    model = LlamaModel(path_model=path, params=params, verbose=False)
    ctx = new_context(
        model.model,
        n_ctx_seq=4096,
        n_seq_max=4,
        n_batch=516,
        n_ubatch=516,
        n_threads=args.threads,
        flash_attn=args.flash_attn,
    )
    memory = llama_cpp.llama_get_memory(ctx)
    batch = Batch(1024)

    def decode(items: list[tuple[int, int, int, bool]]) -> float:
        batch.clear()
        for token, pos, seq, logits in items:
            batch.add(token, pos, seq, logits)
        started = time.perf_counter()
        status = llama_cpp.llama_decode(ctx, batch.ready())
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return time.perf_counter() - started

    def prompt(start: int, n: int) -> list[tuple[int, int, int, bool]]:
        return [(TOKEN + (start + k) % 500, start + k, 3, False) for k in range(n)]

    for seq in range(3):  # three sequences with 200 cells each, then decoding
        decode([(TOKEN + i, i, seq, i == 199) for i in range(200)])
    pos = [200, 200, 200]

    def three() -> list[tuple[int, int, int, bool]]:
        return [(TOKEN, pos[s], s, True) for s in range(3)]

    def advance() -> None:
        for s in range(3):
            pos[s] += 1
            if pos[s] > 3900:  # keep within the sequences' 4,096 cells
                llama_cpp.llama_memory_seq_rm(memory, s, 200, -1)
                pos[s] = 200

    print(
        f"flash attention {args.flash_attn}, {args.threads} thread(s); "
        f"milliseconds, the minimum of {REPEATS} repeats\n"
    )
    print(
        "| prompt position | chunk | D: 3 decodes | P: chunk alone | M: mixed | M - D - P "
        "| prompt tok/s alone | M / D |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for at in POSITIONS:
        llama_cpp.llama_memory_seq_rm(memory, 3, -1, -1)
        filled = 0
        while filled < at:
            n = min(512, at - filled)
            decode(prompt(filled, n))
            filled += n
        for chunk in CHUNKS:
            times: dict[str, list[float]] = {"D": [], "P": [], "M": []}
            for _ in range(REPEATS):
                times["D"].append(decode(three()))
                advance()
                times["P"].append(decode(prompt(at, chunk)))
                llama_cpp.llama_memory_seq_rm(memory, 3, at, -1)
                times["M"].append(decode(three() + prompt(at, chunk)))
                advance()
                llama_cpp.llama_memory_seq_rm(memory, 3, at, -1)
            d, p, m = (min(times[k]) * 1000 for k in ("D", "P", "M"))
            row: list[Any] = [at, chunk, f"{d:.1f}", f"{p:.1f}", f"{m:.1f}", f"{m - d - p:+.1f}"]
            row += [f"{chunk / p * 1000:.0f}", f"{m / d:.1f}"]
            print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
    llama_cpp.llama_free(ctx)


if __name__ == "__main__":
    main()

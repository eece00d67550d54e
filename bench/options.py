"""The harness's run options, passed to every section."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Options:
    quick: bool = False
    #: GGUF for the llama sections; None = the default model.
    model: str | None = None
    #: Threads for every llama contender (0 = all cores, as the server's default).
    threads: int = 0
    n_ctx: int = 4096
    n_batch: int = 512
    out: Path = Path("docs/benchmarks.md")
    #: A git ref: sections 1-2 and 12 also run wsserver as it was at that
    #: commit, side by side, to show a change costs nothing (``--baseline``).
    baseline: str | None = None
    #: Fewer repeats than the full run's in sections 1, 2 and 8 (a busy machine).
    repeats: int | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def n_threads(self) -> int:
        """The llama contenders' threads: ``--threads``, else one per core."""
        return self.threads or os.cpu_count() or 1

    def log(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[bench {elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)

"""Models by name: pulling GGUF files from the Hugging Face Hub.

* :mod:`.reference` — a reference (``org/repo:Q4_K_M``, ``org/repo/file.gguf``,
  ``@revision``) parsed strictly, and which files of a repository it means
  (sans-I/O);
* :mod:`.progress` — how far a pull is, its rate and time left, and how a
  terminal or a log shows it (sans-I/O);
* :mod:`.hub` — the files fetched into the Hub's cache through
  ``huggingface_hub``: resumed, verified, atomic, within the disk and a cap
  (blocking I/O, for a worker thread);
* :mod:`.cache` — what the cache holds: GGUFs, their size, which configured
  model uses them; removing one.

The asyncio side — one download shared by every request that waits for it —
is :mod:`wsserver.aio.pulls`. docs/models.md is the user's guide.
"""

from __future__ import annotations

from .progress import Progress, PullStatus
from .reference import Plan, Reference, RemoteFile, parse_reference, plan_files

__all__ = [
    "Plan",
    "Progress",
    "PullStatus",
    "Reference",
    "RemoteFile",
    "parse_reference",
    "plan_files",
]

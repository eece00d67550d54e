"""The host-memory prompt cache: sequences' KV states kept beyond the slots (used by :mod:`.llama_sequences`).

Theory of operation
-------------------
A context holds ``parallel`` sequences; an agent host or a chat server has
more conversations than that. When a free sequence is given to a prompt that
keeps less than half of the cells it holds — another conversation — those
cells would be lost, and the conversation, when it returns, would be
prefilled again from its first token. Instead its state (the KV cells of the
sequence, through llama.cpp's per-sequence state API:
``llama_state_seq_get_data``) is copied into host memory first, with the
tokens it holds, as an :class:`Entry`; a later prompt that extends it further
than any free sequence does gets it copied back
(``llama_state_seq_set_data``) into a free sequence and decodes only the
rest. That is llama-server's ``--cache-ram`` (its rules, as it has them:
``server_prompt_cache`` in tools/server); copying a state costs a small
fraction of decoding it again (docs/llama.md, "Host-memory prompt cache").

The entries are bounded by bytes (``prompt_cache_bytes``, counted in the
models' memory budget): least recently used first out, an entry that alone
exceeds the bound never kept. An entry whose tokens another entry (or the
state being saved) extends is redundant and is dropped; a state another
entry already extends is not saved again. A restored entry leaves the cache,
as in llama-server: its cells are in the sequence now (cut back to the
prompt's prefix: an old answer's tokens rarely match the next prompt's), and
go back to the cache when the sequence is next given away.

Everything here runs on the engine thread, the only one that touches the
context; :class:`CacheCounters` is read by ``/metrics`` from any thread
(plain integers, written by one thread).
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llama_cpp

__all__ = ["CacheCounters", "Entry", "HostCache", "common_prefix"]

log = logging.getLogger("wsserver.llama")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` have in common from their start.

    Slices compare in C: a bisection over them is far cheaper than a Python
    loop over thousands of tokens, for every entry and sequence at admission."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


@dataclass
class CacheCounters:
    """The prompt cache's figures for ``/metrics``: kept by the backend across
    loads (the counters only grow; ``bytes`` is what is held now)."""

    #: Requests whose prompt was restored from host memory.
    hits: int = 0
    #: Prompt tokens those requests did not decode thanks to it.
    restored_tokens: int = 0
    #: States saved into host memory.
    saves: int = 0
    #: Entries dropped for room (least recently used first).
    evictions: int = 0
    #: Bytes held now (0 while the model is unloaded).
    bytes: int = 0


@dataclass(eq=False)
class Entry:
    """One saved sequence state: the tokens whose cells it holds, the bytes."""

    tokens: list[int]
    data: Any  # a ctypes c_ubyte array, llama.cpp's serialized cells
    size: int
    #: The fewest of its tokens a prompt may keep for it to be restored
    #: (0: any; learnt on a model with sliding-window layers, whose state
    #: holds their cells for its last window only: :mod:`.llama_sequences`).
    least: int = 0


class HostCache:
    """Saved sequence states in host memory, at most ``limit`` bytes (see the
    module docstring). Engine thread only; ``limit`` 0 keeps nothing."""

    def __init__(self, ctx: Any, limit: int, counters: CacheCounters | None = None) -> None:
        self._ctx = ctx
        self.limit = max(0, limit)
        self.counters = counters if counters is not None else CacheCounters()
        self.counters.bytes = 0
        #: Least recently used first.
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._held = 0

    @property
    def held(self) -> int:
        """Bytes the entries hold."""
        return self._held

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        """The entries, least recently used first (tests)."""
        return list(self._entries.values())

    def best(self, prompt: list[int]) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with ``prompt`` (the most
        recently used among equals), and that length; None: no entry shares any."""
        found: tuple[Entry, int] | None = None
        for entry in reversed(self._entries.values()):
            common = common_prefix(entry.tokens, prompt)
            if common and (found is None or common > found[1]):
                found = (entry, common)
        return found

    def save(self, seq: int, tokens: list[int]) -> bool:
        """Copy sequence ``seq``'s cells, which hold ``tokens``, into host
        memory. False: not kept (the cache is off, an entry already extends
        it, it alone exceeds the bound, or llama.cpp could not write it)."""
        if self.limit <= 0 or not tokens:
            return False
        for key, entry in self._entries.items():
            if common_prefix(entry.tokens, tokens) == len(tokens):
                self._entries.move_to_end(key)  # it holds this state already
                return False
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq))
        if size <= 0 or size > self.limit:
            return False
        for key, entry in list(self._entries.items()):
            if common_prefix(entry.tokens, tokens) == len(entry.tokens):
                self._drop(key)  # this state extends it
        try:
            data = (ctypes.c_ubyte * size)()
        except MemoryError:
            log.warning("no memory for a %d-byte prompt state: not cached", size)
            return False
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, data, size, seq))
        if written != size:
            log.warning("llama.cpp wrote %d of a %d-byte prompt state: not cached", written, size)
            return False
        self._add(Entry(list(tokens), data, size))
        self.counters.saves += 1
        return True

    def restore(self, entry: Entry, seq: int) -> bool:
        """Replace sequence ``seq``'s cells with ``entry``'s. False: llama.cpp
        refused it (the sequence's cells are then undefined: the caller
        removes them)."""
        read = int(llama_cpp.llama_state_seq_set_data(self._ctx, entry.data, entry.size, seq))
        return read == entry.size

    def take(self, entry: Entry) -> None:
        """Take ``entry`` out before it is restored (saving the target
        sequence's own state first must not evict it)."""
        self._drop(id(entry.data))

    def put_back(self, entry: Entry) -> None:
        """``entry``, taken, could not be used: back in, most recently used."""
        self._add(entry)

    def used(self, kept: int) -> None:
        """An entry, taken, was restored and its first ``kept`` tokens stay in
        the sequence (its cells live there now, and come back here when the
        sequence is next given away)."""
        self.counters.hits += 1
        self.counters.restored_tokens += kept

    def _add(self, entry: Entry) -> None:
        while self._entries and self._held + entry.size > self.limit:
            self._drop(next(iter(self._entries)))
            self.counters.evictions += 1
        self._entries[id(entry.data)] = entry
        self._held += entry.size
        self.counters.bytes = self._held

    def clear(self) -> None:
        """Free every entry (the model is unloading)."""
        self._entries.clear()
        self._held = 0
        self.counters.bytes = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._held -= entry.size
        self.counters.bytes = self._held

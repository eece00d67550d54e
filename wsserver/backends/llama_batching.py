"""What one step of the batched engine decodes (used by :mod:`.llama_engine`).

:class:`Batcher` owns the engine's batch, its prompt budget and the log of
its latest steps. :func:`plan_step` fills the step's batch: the next token
of every decoding sequence whose text was delivered, plus prompt tokens of
prefilling sequences, oldest first, up to a share: while anyone else is
decoding, what fits in a time budget (a step lasts at most
``prefill_gap_ms``, sized from the engine's own measurements:
:mod:`.llama_budget`), so a long prompt does not freeze the others; ``n_batch`` when no one is. A sequence paused on its channel (its
last text refused) has no part in it.

The batch holds the tokens in sequence order, not admission order: with one
KV stream per sequence llama.cpp keeps tokens in one micro-batch only while
each next sequence id is the last + 1.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .llama_budget import PrefillBudget
from .llama_context import Batch
from .llama_sequences import Job

__all__ = [
    "Batcher",
    "StepPlan",
    "decoding",
    "plan_step",
    "prefilling",
]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's part of each sequence in its batch."""

    #: The sequences that decode their next token in this step.
    decoding: list[Job]
    #: Each sequence in the batch, in batch order: its job, the tokens it
    #: feeds, and the index of its logits (-1: a prompt chunk that samples nothing).
    parts: list[tuple[Job, int, int]]
    #: The prompt tokens the step could take (its budget; 0: no prompt pending).
    share: int
    #: The requests whose first prompt tokens the step decodes.
    first_chunks: list[Job]


def prefilling(jobs: list[Job]) -> bool:
    """Whether any of ``jobs`` still has prompt tokens to decode."""
    return any(j.fed < len(j.prompt) and not j.cancelled for j in jobs)


def decoding(jobs: list[Job]) -> int:
    """How many of ``jobs`` decode a token this step (their text delivered)."""
    return sum(1 for j in jobs if j.next_token is not None and not j.waiting_room)


def plan_step(jobs: list[Job], budget: PrefillBudget, batch: Batch, used: int = 0) -> StepPlan:
    """Choose each of ``jobs``' part of the next step and put it in ``batch``
    (cleared first); ``jobs`` in admission order; ``used``: prompt positions
    the step already took (an image's embeddings), out of its share. A job with prompt tokens
    in the step is marked ``in_flight`` (a cancel then aborts the decode).
    Called under the engine's condition: cancels change ``jobs`` meanwhile."""
    batch.clear()
    decoding = [j for j in jobs if j.next_token is not None and not j.outbox and not j.waiting_room]
    # Each sequence's part of the step: its next token, or a chunk of its prompt.
    parts: list[tuple[Job, int]] = [(job, 1) for job in decoding]
    share = left = max(0, budget.share(len(decoding)) - used) if prefilling(jobs) else 0
    first_chunks: list[Job] = []
    for job in jobs:
        # Up to the next image: the engine decodes its embeddings apart.
        remaining = job.text_end() - job.fed
        if remaining <= 0 or left <= 0 or job.cancelled:
            continue
        take = min(remaining, left)
        if take == remaining > 1 and decoding and job.fed:
            # The last chunk of a prompt ingested over several steps: its
            # last token computes logits and samples, as a decoding
            # sequence does, and the step leaves room for that. (A prompt
            # that fits one step goes whole: its first token comes first.)
            room = left - budget.output_tokens(len(decoding))
            if room < remaining:
                take = min(remaining - 1, max(1, room))
        left -= take
        parts.append((job, take))
        job.in_flight = True
        if not job.started:
            job.started = True
            first_chunks.append(job)
    # In sequence order: with one KV stream per sequence llama.cpp keeps
    # tokens in one micro-batch only while each next sequence id is the
    # last + 1, in batch order; admission order would split a step into
    # several passes over the weights once sequences are reused.
    parts.sort(key=lambda part: part[0].seq.index if part[0].seq is not None else -1)
    placed: list[tuple[Job, int, int]] = []
    for job, take in parts:
        assert job.seq is not None
        start = len(job.seq.tokens)
        if job.fed >= len(job.prompt):
            assert job.next_token is not None
            placed.append((job, 1, batch.add(job.next_token, start, job.seq.index, True)))
            continue
        index = -1
        for k in range(take):
            last = job.fed + k == len(job.prompt) - 1
            i = batch.add(job.prompt[job.fed + k], start + k, job.seq.index, last)
            if last:
                index = i
        placed.append((job, take, index))
    return StepPlan(decoding, placed, share, first_chunks)


class Batcher:
    """The engine's batch and its prompt budget: each step's plan, and what
    each step cost (see the module docstring). Used on the engine thread;
    ``prefill_budget``, ``prefill_gap_ms`` and ``prefill_chunk`` are
    :class:`.PrefillBudget`'s ``factor``, ``gap_s`` (in ms) and ``fixed``."""

    def __init__(
        self,
        *,
        n_batch: int,
        parallel: int,
        prefill_chunk: int,
        prefill_budget: float,
        prefill_gap_ms: float,
        log_size: int,
    ) -> None:
        #: Prompt tokens per step while others decode (see :mod:`.llama_budget`).
        self.budget = PrefillBudget(
            prefill_budget,
            n_batch,
            fixed=max(1, min(prefill_chunk, n_batch)),
            gap_s=prefill_gap_ms / 1000,
        )
        #: Room for ``n_batch`` prompt tokens and every sequence's next token.
        self.batch = Batch(n_batch + parallel)
        #: The latest steps, oldest first: (decoding sequences, prompt tokens,
        #: the prompt's share, the step's seconds) — for tests and the bench.
        self.step_log: deque[tuple[int, int, int, float]] = deque(maxlen=log_size)

    def plan(self, jobs: list[Job], used: int = 0) -> StepPlan:
        """The next step's plan, its tokens put in :attr:`batch` (see :func:`plan_step`)."""
        return plan_step(jobs, self.budget, self.batch, used)

    def observe(self, step: StepPlan, seconds: float) -> None:
        """``step`` lasted ``seconds``, from its first token delivered to its
        last sampled: what the decoding sequences waited (the budget learns it)."""
        prompt_tokens = self.batch.n - len(step.decoding)
        self.budget.observe(len(step.decoding), prompt_tokens, seconds)
        self.step_log.append((len(step.decoding), prompt_tokens, step.share, seconds))

    def free(self) -> None:
        self.batch.free()

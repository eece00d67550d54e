"""What one step of the batched engine decodes (used by :mod:`.llama_engine`).

:class:`Batcher` owns the engine's batch, its prompt budget and the log of
its latest steps. :func:`plan_step` fills the step's batch: the next token
of every decoding sequence whose text was delivered, plus prompt tokens of
prefilling sequences, oldest first, up to a share: while anyone else is
decoding, what fits in a time budget (a step lasts at most
``prefill_gap_ms``, sized from the engine's own measurements:
:mod:`.llama_budget`), so a long prompt does not freeze the others;
``n_batch`` when no one is. A sequence paused on its channel (its last text
refused) has no part in it. A decoding sequence that speculates adds its
n-gram draft after its next token, each with logits
(:mod:`.llama_speculation`); :func:`verify` samples them after the decode.
Drafts go only in steps without prompt tokens and while no embedding work
waits (a prompt's chunk and an embedding piece are sized to fill the step's
time; drafts would overrun it), and while other sequences
wait for the step, all drafts together fit in the room the gap bound leaves
(:meth:`.PrefillBudget.draft_rows`); the budget learns from steps without
drafts.

The batch holds the tokens in sequence order, not admission order: with one
KV stream per sequence llama.cpp keeps tokens in one micro-batch only while
each next sequence id is the last + 1.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .llama_budget import PrefillBudget
from .llama_context import Batch
from .llama_sequences import Job, SequenceState

__all__ = [
    "Batcher",
    "StepPlan",
    "decoding",
    "draft_for",
    "plan_step",
    "prefilling",
    "verify",
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
    #: Draft tokens in the batch, after their sequences' next tokens.
    drafted: int = 0


def prefilling(jobs: list[Job]) -> bool:
    """Whether any of ``jobs`` still has prompt tokens to decode."""
    return any(j.fed < len(j.prompt) and not j.cancelled for j in jobs)


def decoding(jobs: list[Job]) -> int:
    """How many of ``jobs`` decode a token this step (their text delivered)."""
    return sum(1 for j in jobs if j.next_token is not None and not j.waiting_room)


def embed_room(
    jobs: list[Job], budget: PrefillBudget, spent: float, turn: bool
) -> tuple[bool, float | None]:
    """Whether this step's embedding work decodes, and in what room (seconds;
    None: nothing decodes beside it, so what one decode holds; 0: unmeasured,
    the smallest piece). ``spent``: the step so far. While a prompt is
    prefilled the step is the prompt's (a first token is someone's wait) but
    on the work's ``turn`` (:attr:`.Embedder.turn_due`: the prompts' share
    went to it this step); beside decoding streams, the room the budget
    leaves less what the step overran their decode (on a turn, at least the
    smallest piece: the prompts it held up are held up once, not again)."""
    n = decoding(jobs)
    room = budget.room(n) if n else 0.0
    left = room - max(0.0, spent - (budget.decode_time(n) or spent))
    held = prefilling(jobs)
    if (held and not turn) or (not held and room > 0 and left <= 0):
        return False, None
    return True, (max(left, 0.0) if n else None)


def draft_for(job: Job, room: int | None = None) -> list[int]:
    """The draft ``job`` decodes beside its next token this step (empty: none):
    none while close-tag tokens are due (they are written, not sampled), none
    past what ``max_tokens`` lets it emit (the context is within it), and at
    most ``room`` tokens (None: no bound but the drafter's)."""
    if job.drafter is None or job.next_token is None or job.forced or job.seq is None:
        return []
    if job.budget is not None and job.budget.exhausted():
        return []
    limit = job.max_tokens - job.produced - 1
    if room is not None:
        limit = min(limit, room)
    return job.drafter.propose(job.seq.tokens, job.next_token, limit)


def plan_step(
    jobs: list[Job],
    budget: PrefillBudget,
    batch: Batch,
    used: int = 0,
    drafts: bool = True,
    prompts: bool = True,
) -> StepPlan:
    """Choose each of ``jobs``' part of the next step and put it in ``batch``
    (cleared first); ``jobs`` in admission order; ``used``: prompt positions
    the step already took (an image's embeddings), out of its share;
    ``drafts``: whether speculating sequences may draft (not while embedding
    work waits to take the step's room); ``prompts``: whether prompts get
    their share (not on embedding work's turn, :func:`embed_room`). A job with prompt tokens
    in the step is marked ``in_flight`` (a cancel then aborts the decode).
    Called under the engine's condition: cancels change ``jobs`` meanwhile."""
    batch.clear()
    decoding = [j for j in jobs if j.next_token is not None and not j.outbox and not j.waiting_room]
    # Each sequence's part of the step: its next token, or a chunk of its prompt.
    parts: list[tuple[Job, int]] = [(job, 1) for job in decoding]
    share = left = max(0, budget.share(len(decoding)) - used) if prompts and prefilling(jobs) else 0
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
    drafted = 0
    # Drafts only in a step without prompt tokens (the prompt's share is
    # sized by time; drafts would take it), and while others wait for the
    # step, at most what fits in the gap, shared out.
    mixed = not drafts or used > 0 or any(job.fed < len(job.prompt) for job, _ in parts)
    rows = None if mixed else budget.draft_rows(len(decoding))
    each = None if rows is None else rows // max(1, len(decoding))
    for job, take in parts:
        assert job.seq is not None
        start = len(job.seq.tokens)
        if job.fed >= len(job.prompt):
            assert job.next_token is not None
            job.draft = [] if mixed else draft_for(job, each)
            placed.append((job, 1, batch.add(job.next_token, start, job.seq.index, True)))
            for k, token in enumerate(job.draft, 1):
                batch.add(token, start + k, job.seq.index, True)
            drafted += len(job.draft)
            continue
        index = -1
        for k in range(take):
            last = job.fed + k == len(job.prompt) - 1
            i = batch.add(job.prompt[job.fed + k], start + k, job.seq.index, last)
            if last:
                index = i
        placed.append((job, take, index))
    return StepPlan(decoding, placed, share, first_chunks, drafted)


def verify(
    job: Job,
    index: int,
    sample: Callable[[Job, int], None],
    rollback: Callable[[SequenceState], None],
    stats: dict[str, int],
) -> None:
    """Sample ``job`` at ``index`` (its next token's logits) and, while each
    sampled token equals its draft's token there, at that draft token's index
    too (the one after it); the draft's rejected tokens' cells are removed
    (:mod:`.llama_speculation`). ``sample`` emits a token as the engine does
    (EOG, stop strings, ``max_tokens``, grammar, logprobs, delivery): a
    sequence that ends, is cancelled or paused on its channel stops there
    (a cancelled one samples nothing)."""
    draft, job.draft = job.draft, []
    # Counted before the tokens go out: the last one may complete the request.
    job.stats.drafted += len(draft)
    stats["draft_tokens"] += len(draft)
    accepted = 0
    if not job.cancelled:
        sample(job, index)
        for token in draft:
            if job.next_token != token or job.cancelled or job.waiting_room:
                break
            job.commit(1)  # its cell, decoded this step, holds the token sampled: it stays
            accepted += 1
            job.stats.accepted += 1
            stats["draft_tokens_accepted"] += 1
            sample(job, index + accepted)
    if draft:
        assert job.seq is not None and job.drafter is not None
        rollback(job.seq)  # the cells past the committed tokens: the rejected draft's
        job.drafter.verified(len(draft), accepted)


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
        draft_max: int = 0,
    ) -> None:
        #: Prompt tokens per step while others decode (see :mod:`.llama_budget`).
        self.budget = PrefillBudget(
            prefill_budget,
            n_batch,
            fixed=max(1, min(prefill_chunk, n_batch)),
            gap_s=prefill_gap_ms / 1000,
        )
        #: Room for ``n_batch`` prompt tokens and every sequence's next
        #: token with its draft (``draft_max``: the longest; 0, none).
        self.batch = Batch(n_batch + parallel * (1 + draft_max))
        #: The latest steps, oldest first: (decoding sequences, prompt tokens,
        #: the prompt's share, the step's seconds, draft tokens) — for tests
        #: and the bench.
        self.step_log: deque[tuple[int, int, int, float, int]] = deque(maxlen=log_size)

    def plan(
        self, jobs: list[Job], used: int = 0, drafts: bool = True, *, prompts: bool = True
    ) -> StepPlan:
        """The next step's plan, its tokens put in :attr:`batch` (see :func:`plan_step`)."""
        return plan_step(jobs, self.budget, self.batch, used, drafts, prompts)

    def observe(self, step: StepPlan, seconds: float) -> None:
        """``step`` lasted ``seconds``, from its first token delivered to its
        last sampled: what the decoding sequences waited (the budget learns it
        from steps without drafts: a draft's tokens cost more than a prompt's,
        and its steps would make the decode-only step look longer than it is)."""
        prompt_tokens = self.batch.n - len(step.decoding) - step.drafted
        if not step.drafted:
            self.budget.observe(len(step.decoding), prompt_tokens, seconds)
        self.step_log.append((len(step.decoding), prompt_tokens, step.share, seconds, step.drafted))

    def free(self) -> None:
        self.batch.free()

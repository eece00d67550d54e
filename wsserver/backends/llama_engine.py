"""The batched engine: one thread, one llama.cpp context, many sequences.

Theory of operation
-------------------
:class:`BatchEngine` owns a context of ``parallel`` sequences (see
:func:`.llama_context.new_context`) and one thread that runs the step loop.
The event loop only hands it requests (:meth:`BatchEngine.submit`) and
cancels (a :class:`~wsserver.backends.base.CancelEvent` callback); channels
with room again wake it through ``Sink.when_room``. It sleeps on a condition
variable when nothing can run — idle, or every sequence paused on a full
channel — and never polls.

One step:

1. **Cancels first.** A cancelled request leaves at once: no ``end`` (the
   client had its ``done`` from the core), its sampler is freed and its
   submission completed. Its sequence keeps exactly the cells that were
   committed (see the prompt cache below).
2. **Admission.** New requests are tokenized here (off the loop) and given a
   free sequence: the one whose cached tokens share the longest prefix with
   the prompt, relative to the prompt's length, if that is above
   :data:`PREFIX_SIMILARITY` (llama-server's rule), else the lowest free one
   (which keeps the decoding sequences' ids contiguous: with one KV stream per
   sequence llama.cpp computes consecutive sequence ids in one micro-batch).
   The tail after the common prefix is removed (``llama_memory_seq_rm``) and
   only the rest is prefilled — always at least the last prompt token, whose
   logits start the completion.
3. **One batch.** The next token of every decoding sequence whose text was
   delivered, plus prompt tokens of prefilling sequences, oldest first, up to
   a share: while anyone else is decoding, what fits in a time budget (a step
   lasts at most ``prefill_budget`` times their decode-only step, from the
   engine's own measurements: :mod:`.llama_budget`), so a long prompt does
   not freeze the others; ``n_batch`` when no one is. A sequence whose last text its channel refused
   (``Sink.offer`` → False: a slow client) sits out, holding that one token's
   text, until ``when_room`` fires — its memory stays bounded by its channel,
   the others keep their pace.
4. **Decode**, then sample every sequence that asked for logits with its own
   native sampler chain (and its grammar, checked against the sampled token
   first: :mod:`.llama_grammar`; a plain greedy request takes the logits'
   argmax, which is what its chain would pick, without the chain's pass
   over a full candidate list), and run the text through its
   :class:`~wsserver.core.textstream.TextAssembler` (UTF-8, stop strings); EOG,
   a stop string, ``max_tokens`` or the sequence's full context end it.

Reasoning budget
----------------
A request with ``reasoning_budget`` counts its tokens inside the think block
(:class:`~wsserver.shaping.reasoning.ReasoningBudget`; whether the prompt opened the
block is the backend's ``opens_reasoning``). When the block holds that many
and is still open, the sequence's next tokens are the close tag's
(``reasoning_close``: :data:`~wsserver.shaping.reasoning.FORCED_CLOSE` tokenized),
taken instead of sampled, one per step like any token — decoded, written to
the text stream (so the core's reasoning split sees the close) and counted as
completion tokens — and then the model samples its answer. A request without
a budget pays one ``is None`` test per token.

Cancel during a decode
----------------------
A cancel whose request has *prompt* tokens in the decode in flight raises the
context's native abort flag: ggml stops after the graph node it is computing
and ``llama_decode`` returns 2, having kept the micro-batches it finished. The
engine then removes every batch sequence's cells from its pre-batch position
on, so each is exactly where it was before the step, and the survivors simply
run their part again next step. (A cancelled sequence with only its one
decode token in flight is not worth aborting for: the step ends in
milliseconds, and aborting would make the others redo it.)

Grammar work and its deadline
-----------------------------
A constrained sequence's sampling — the grammar's check of the sampled token,
its filtering of candidates, its acceptance of the token — is llama.cpp
native code that nothing interrupts, and an ambiguous grammar can make one
call of it last for ever. :mod:`.grammar_bounds` refuses every grammar shape
known to do that before the request starts; for the rest, the engine takes
the sequence's logits (a copy) and hands that work to a
:class:`~.grammar_worker.GrammarWorker` thread, waiting at most
``grammar_deadline_s`` and no longer once the request is cancelled. Past
that the request ends (``unsupported_option``), its samplers and the
candidate buffers go with the worker (which frees them when its call
returns), and a fresh worker and buffers serve the next sequences: every
other stream goes on at the next step. So the others wait at most the
deadline, once; the worker's call runs on until it returns
(:meth:`BatchEngine.grammar_calls_running`), and the model is not freed
under it (``close``).

Liveness
--------
The engine records when its running step began. A step that has lasted
``stall_s`` makes it *stalled* (:meth:`BatchEngine.stalled`): the backend's
``unready_reason`` (``/readyz`` 503), a metric, and one ERROR line saying what
the step is doing (``_doing``: admitting, decoding a batch, sampling under a
grammar) and which requests it holds. Idle, or with every sequence paused on
a slow client, no step runs, and nothing is stalled.

Prompt cache
------------
A sequence's :attr:`SequenceState.tokens` are the tokens whose KV cells it
holds, by position — updated only when a decode succeeded and rolled back
when one was aborted, so it is exact. Finished and cancelled requests leave
their cells for the next request with the same prefix (the next turn of a
chat, a regenerate); any other request removes them first. KV state thus
never reaches another request except as a prefix of its own prompt.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np

from ..core.logprobs import TokenLogprob
from ..core.protocol import DoneReason
from ..core.textstream import TextAssembler
from ..errors import BackendError
from ..logs import context
from ..shaping.reasoning import ReasoningBudget
from .base import CancelEvent, GenerationRequest, Outcome, Sink, Submission
from .grammar_worker import GrammarWorker
from .llama_budget import PrefillBudget
from .llama_context import (
    AbortFlag,
    Batch,
    chain_keeps,
    has_history,
    new_sampler,
    penalty_window,
    quiet_errors,
)
from .llama_embed import Embedder
from .llama_grammar import Candidates, GrammarCache, utf8_needed
from .llama_logprobs import LogprobReader
from .llama_sequences import Job, RequestStats, SequenceState, common_prefix

__all__ = ["PREFIX_SIMILARITY", "BatchEngine", "RequestStats", "SequenceState"]

log = logging.getLogger("wsserver.llama")

#: llama-server's ``--slot-prompt-similarity`` default: below this share of
#: the prompt in common, a cached sequence is not worth routing to.
PREFIX_SIMILARITY = 0.1
#: Per-request counters kept for tests and the bench, newest last.
_STATS_KEPT = 256

Prepare = Callable[[GenerationRequest], tuple[list[int], tuple[str, ...]]]


class BatchEngine:
    """The step loop over one context (see the module docstring)."""

    def __init__(
        self,
        *,
        ctx: Any,
        vocab: Any,
        n_ctx: int,
        parallel: int,
        n_batch: int,
        prefill_chunk: int,
        prepare: Prepare,
        prefill_budget: float = 2.0,
        prefill_floor_ms: float = 0.0,
        piece: Callable[[int], bytes],
        read_piece: Callable[[int], bytes] | None = None,
        tokenize_text: Callable[[str], list[int]] | None = None,
        native_abort: bool = True,
        reasoning_close: tuple[int, ...] = (),
        opens_reasoning: Callable[[GenerationRequest], bool] | None = None,
        grammar_deadline_s: float = 1.0,
        stall_s: float = 30.0,
    ) -> None:
        self.ctx = ctx
        self._vocab = vocab
        self._memory = llama_cpp.llama_get_memory(ctx)
        #: Prompt + completion per sequence: what was asked, within what llama.cpp made.
        self.n_ctx = min(n_ctx, llama_cpp.llama_n_ctx_seq(ctx))
        self.n_batch = n_batch
        #: Prompt tokens per step while others decode (see :mod:`.llama_budget`).
        self.budget = PrefillBudget(
            prefill_budget,
            n_batch,
            fixed=max(1, min(prefill_chunk, n_batch)),
            floor_s=prefill_floor_ms / 1000,
        )
        self._prepare = prepare
        self._piece = piece
        self._tokenize_text = tokenize_text
        #: The tokens that close a think block whose budget is spent, and
        #: whether a request's prompt opened the block (see the module docstring).
        self.reasoning_close = reasoning_close
        self._opens_reasoning = opens_reasoning
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(vocab)
        self.grammars = GrammarCache(vocab)
        self.logprobs = LogprobReader(self.n_vocab, piece)
        #: The candidate lists of constrained sequences. Built here, with the
        #: model (a pass over the vocabulary: ~1 s for 262,144 tokens), not at
        #: the first constrained request, where it would stall every stream.
        #: ``read_piece``: ``piece`` uncached, so that pass fills no cache.
        self._candidates = Candidates(vocab, self.n_vocab, read_piece or piece)
        #: Filter by the grammar over the whole vocabulary, as llama.cpp's
        #: common sampler does, instead of :meth:`.Candidates.constrain`'s
        #: shortcut — the reference the tests compare the shortcut with.
        self.exact_filter = False
        self.sequences = [SequenceState(i) for i in range(parallel)]
        self._batch = Batch(n_batch + parallel)
        self.flag = AbortFlag(ctx, native=native_abort)
        self._cond = threading.Condition(threading.RLock())
        #: A sequence's grammar work, this long at most per step (see the
        #: module docstring, "Grammar work and its deadline").
        self.grammar_deadline_s = grammar_deadline_s
        self._worker = GrammarWorker(self._cond)
        #: Workers given up on whose native call may still run (they end by themselves).
        self._abandoned: list[GrammarWorker] = []
        #: Liveness: when the running step began (None: between steps), what
        #: it is doing now, and after how long a step counts as stalled.
        self.stall_s = stall_s
        self._step_began: float | None = None
        self._doing: tuple[str, str] = ("idle", "")
        self._stall_reported = False
        self._incoming: list[Job] = []
        self._jobs: list[Job] = []  # admitted, in admission order
        self._stopping = False
        #: Seconds spent in ``llama_decode`` and in sampling + text, for the benchmark.
        self.seconds: dict[str, float] = {"decode": 0.0, "sample": 0.0}
        self.stats: dict[str, int] = {
            "requests": 0,
            "aborts": 0,
            "steps": 0,
            "prompt_tokens_reused": 0,
            "prompt_tokens_decoded": 0,
            "max_batch_sequences": 0,
            # Constrained sequences: sampled tokens the grammar rejected, and
            # the tokens it was then asked about (the whole vocabulary each
            # time without Candidates.constrain's shortcut).
            "grammar_rejections": 0,
            "grammar_tokens_asked": 0,
            # Grammar work given up on past its deadline (or its cancel).
            "grammar_abandoned": 0,
        }
        self.request_stats: dict[str, RequestStats] = {}
        #: The latest steps, oldest first: (decoding sequences, prompt tokens,
        #: the prompt's share, seconds in ``llama_decode``) — for tests and the bench.
        self.step_log: deque[tuple[int, int, int, float]] = deque(maxlen=4 * _STATS_KEPT)
        #: Called on the engine thread just before a request's first prompt
        #: tokens are decoded, with its ID and prompt length (the abort flag is
        #: armed for it by then). For tests and metrics; quick, must not raise.
        self.on_prefill: Callable[[str, int], None] | None = None
        #: The model's embedding work, stepped after the streams' decode
        #: (:meth:`attach_embedder`; None: the model embeds nothing yet).
        self.embedder: Embedder | None = None
        self._thread = threading.Thread(target=self._run, name="wsserver-llama-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ loop side

    def submit(self, request: GenerationRequest, sink: Sink, cancel: CancelEvent) -> Submission:
        stats = RequestStats()
        self.request_stats[request.id] = stats
        while len(self.request_stats) > _STATS_KEPT:
            del self.request_stats[next(iter(self.request_stats))]
        job = Job(request, sink, cancel, Submission(), stats)
        with self._cond:
            self._incoming.append(job)
            self._cond.notify()
        job.on_cancel = functools.partial(self._on_cancel, job)
        cancel.add_callback(job.on_cancel)
        return job.submission

    def attach_embedder(self, embedder: Embedder) -> None:
        """Run ``embedder``'s work on this thread, in each step after the
        streams' decode, within the prefill budget's room (:mod:`.llama_embed`)."""
        embedder.bind(self._cond)
        with self._cond:
            self.embedder = embedder
            self._cond.notify()

    def _on_cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled = True
            if job.in_flight:
                self.flag.raise_()
            self._cond.notify()

    def _on_room(self, job: Job) -> None:
        with self._cond:
            job.waiting_room = False
            self._cond.notify()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the step loop and free what it holds. False: the engine thread
        did not end within ``timeout`` (stuck in a native call), or a grammar
        call given up on still runs — nothing native was freed then, and the
        model must not be either (it is leaked until the process exits)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error(
                "the batched engine did not stop within %.1fs (it is %s); leaving its memory",
                timeout or 0.0,
                self._describe_doing(),
            )
            return False
        self._worker.close()
        for job in self._jobs:
            self._free_sampler(job)
        self._batch.free()
        if self.grammar_calls_running():
            log.error(
                "%d grammar computation(s) given up on still run natively; leaving the "
                "model's memory to them",
                self.grammar_calls_running(),
            )
            return False
        self.grammars.close()
        return True

    # ------------------------------------------------------------ liveness

    def grammar_calls_running(self) -> int:
        """Grammar computations given up on (their request ended) whose native
        call still runs, each keeping a core busy."""
        self._abandoned = [w for w in self._abandoned if w.alive()]
        return len(self._abandoned)

    def step_seconds(self) -> float:
        """How long the running step has lasted so far (0: between steps).
        Idle, or with every sequence paused on a slow client, no step runs."""
        began = self._step_began
        return 0.0 if began is None else max(0.0, time.monotonic() - began)

    def stalled(self) -> str | None:
        """Why the engine counts as stalled — a step has run for ``stall_s``
        or more — or None. The first time in a stall it is logged at ERROR
        with what the engine is doing (any thread may ask: the probe does)."""
        seconds = self.step_seconds()
        if self.stall_s <= 0 or seconds < self.stall_s:
            return None
        running = len(self._jobs)
        reason = (
            f"the llama engine has not finished a step for {seconds:.1f} s "
            f"({running} request(s) running)"
        )
        if not self._stall_reported:
            self._stall_reported = True
            log.error(
                "%s: it is %s; requests: %s",
                reason,
                self._describe_doing(),
                self._describe_jobs(),
                extra={"stalled_s": round(seconds, 1)},
            )
        return reason

    def _describe_doing(self) -> str:
        phase, request_id = self._doing
        return f"{phase} (request {request_id})" if request_id else phase

    def _describe_jobs(self) -> str:
        parts = []
        for job in list(self._jobs)[:16]:
            state = "prompt" if job.fed < len(job.prompt) else "decoding"
            if job.grammar is not None:
                state += ", grammar"
            if job.waiting_room:
                state += ", paused on its client"
            parts.append(f"{job.request.id} ({state}, {job.produced} tokens)")
        return ", ".join(parts) or "none"

    # ------------------------------------------------------------ the loop

    def _runnable(self) -> bool:
        if self._incoming or self._stopping:
            return True
        if self.embedder is not None and self.embedder.runnable():
            return True
        for job in self._jobs:
            if job.cancelled:
                return True
            if job.waiting_room:
                continue
            if job.outbox or job.ending or job.next_token is not None:
                return True
            if job.fed < len(job.prompt):
                return True
        return False

    def _run(self) -> None:
        quiet_errors(self.flag)
        while True:
            with self._cond:
                while not self._runnable():
                    self._cond.wait()
                if self._stopping:
                    return
                incoming, self._incoming = self._incoming, []
            self._step_began = time.monotonic()
            try:
                self._step(incoming)
            except Exception:  # a bug here must not kill the engine silently
                log.exception("the batched engine failed; ending its requests")
                for job in self._jobs + incoming:
                    if not job.submission.done:
                        self._fail(job, "the backend failed", code="internal")
                self._jobs = []
                if self.embedder is not None:
                    self.embedder.fail_all("the backend failed")
            if self._stall_reported:
                log.warning(
                    "the llama engine finished a step again, after %.1f s",
                    time.monotonic() - self._step_began,
                )
                self._stall_reported = False
            self._step_began = None
            self._doing = ("idle", "")

    def _step(self, incoming: list[Job]) -> None:
        for job in list(self._jobs):
            if job.cancelled:
                self._leave(job)
        for job in incoming:
            if job.cancelled:
                self._leave(job)
            else:
                self._doing = (
                    "admitting (tokenizing its prompt, compiling its grammar)",
                    job.request.id,
                )
                self._admit(job)
        # A step as the decoding sequences see it: the last step's tokens go
        # out, the next batch is built, decoded and sampled. Admission (a new
        # prompt's tokenization) happens once, not every step: left out.
        begun = time.perf_counter()
        for job in list(self._jobs):
            if (job.outbox or job.ending) and not job.waiting_room:
                self._deliver(job)
        self._decode_step(begun)
        if self.embedder is not None:
            self._embed_step()

    def _embed_step(self) -> None:
        """The embedding work's part of the step (:mod:`.llama_embed`): none
        while a prompt is prefilled (the step was its), else whole inputs
        within the room the budget leaves beside the decoding sequences (no
        bound when none decode)."""
        assert self.embedder is not None
        if self._prefilling():
            self.embedder.step(None, decode=False)  # its cancels still go at once
            return
        decoding = sum(1 for j in self._jobs if j.next_token is not None and not j.waiting_room)
        self._doing = ("embedding inputs", "")
        self.embedder.step(self.budget.room(decoding) if decoding else None)

    # ------------------------------------------------------------ admission

    def _admit(self, job: Job) -> None:
        request = job.request
        try:
            prompt, stops = self._prepare(request)
        except BackendError as exc:
            self._fail(job, str(exc), code=exc.code)
            return
        except Exception as exc:
            log.warning("id=%s tokenizing failed: %r", request.id, exc)
            self._fail(job, "the prompt could not be tokenized")
            return
        if not prompt:  # the input's fault (the backend refuses it before: bad_request too)
            self._fail(job, "the prompt is empty", code="bad_request")
            return
        try:
            bias = self.logit_bias(request)
            job.grammar = self.grammars.instance(
                grammar=request.grammar, json_schema=request.json_schema
            )
        except BackendError as exc:
            self._fail(job, str(exc), code=exc.code)
            return
        if len(prompt) >= self.n_ctx:
            self._fail(
                job,
                f"the prompt is {len(prompt)} tokens; the context holds {self.n_ctx} "
                "tokens for prompt and completion together",
                code="too_large",
            )
            return
        seq = self._choose(prompt)
        if seq is None:  # the scheduler grants at most `parallel` slots
            self._fail(job, "no free sequence", code="internal")
            return
        keep = min(common_prefix(seq.tokens, prompt), len(prompt) - 1)
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq.index, keep, -1):
            keep = 0  # a memory that cannot cut a sequence short
            llama_cpp.llama_memory_seq_rm(self._memory, seq.index, -1, -1)
        del seq.tokens[keep:]
        seq.job = job
        job.seq = seq
        job.prompt = prompt
        job.fed = keep
        # As llama-cpp-python does: the completion gets what room is left.
        job.max_tokens = min(request.max_tokens, self.n_ctx - len(prompt))
        seed = request.seed if request.seed is not None else random.getrandbits(32)
        sampling = request.sampling
        chain = functools.partial(
            new_sampler,
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            seed=seed,
            sampling=sampling,
            vocab=self._vocab,
            n_vocab=self.n_vocab,
            n_ctx=self.n_ctx,
            bias=bias,
        )
        if job.grammar is None:
            job.sampler = chain()
            job.argmax = (
                request.temperature == 0.0
                and not bias
                and not has_history(sampling)
                and not sampling.xtc
            )
        else:  # the grammar goes between the two parts (see _sample_constrained)
            job.pre = chain(part="pre")
            job.sampler = chain(part="post")
            job.keeps = chain_keeps(
                temperature=request.temperature, top_k=request.top_k, sampling=sampling
            )
        if has_history(sampling):
            # As llama-server: the penalties and DRY see the prompt too, so a
            # model that repeats its question is held back from the start.
            window = max(
                penalty_window(sampling.repeat_last_n, self.n_ctx) if sampling.penalties else 0,
                penalty_window(sampling.dry_penalty_last_n, self.n_ctx) if sampling.dry else 0,
            )
            history = job.sampler if job.grammar is None else job.pre
            for token in prompt[max(0, len(prompt) - window) :]:
                llama_cpp.llama_sampler_accept(history, token)
        job.assembler = TextAssembler(stops)
        if request.reasoning_budget is not None and self.reasoning_close:
            opened = self._opens_reasoning is not None and self._opens_reasoning(request)
            job.budget = ReasoningBudget(request.reasoning_budget, opened=opened)
        job.stats.prompt_tokens = len(prompt)
        job.stats.reused = keep
        job.stats.sequence = seq.index
        self.stats["requests"] += 1
        self.stats["prompt_tokens_reused"] += keep
        self._jobs.append(job)
        log.debug(
            "id=%s sequence %d: %d prompt tokens, %d from the cache",
            request.id,
            seq.index,
            len(prompt),
            keep,
            extra=context(request.conn_id, request.id),
        )

    def logit_bias(self, request: GenerationRequest) -> list[tuple[int, float]]:
        """The request's ``logit_bias`` as token ids: a text's tokens each get
        its bias (llama-server's extension). Raises ``BackendError``
        (``bad_request``) for an id outside the vocabulary."""
        out: list[tuple[int, float]] = []
        for key, value in request.sampling.logit_bias:
            if isinstance(key, int):
                if not 0 <= key < self.n_vocab:
                    raise BackendError(
                        f"logit_bias: token {key} is not in the model's vocabulary "
                        f"(ids 0 to {self.n_vocab - 1})",
                        code="bad_request",
                    )
                out.append((key, value))
            elif self._tokenize_text is not None:
                out.extend((token, value) for token in self._tokenize_text(key))
        return out

    def _choose(self, prompt: list[int]) -> SequenceState | None:
        free = [s for s in self.sequences if s.job is None]
        if not free:
            return None
        best = max(free, key=lambda s: common_prefix(s.tokens, prompt))
        if common_prefix(best.tokens, prompt) / len(prompt) > PREFIX_SIMILARITY:
            return best
        return free[0]

    # ------------------------------------------------------------ one step

    def _decode_step(self, begun: float) -> None:
        batch = self._batch
        batch.clear()
        plan: list[tuple[Job, int, int]] = []  # job, tokens fed, logits index or -1
        with self._cond:
            self.flag.lower()
            decoding = [
                j
                for j in self._jobs
                if j.next_token is not None and not j.outbox and not j.waiting_room
            ]
            # Each sequence's part of the step: its next token, or a chunk of its prompt.
            parts: list[tuple[Job, int]] = [(job, 1) for job in decoding]
            share = budget = self.budget.share(len(decoding)) if self._prefilling() else 0
            first_chunks: list[Job] = []
            for job in self._jobs:
                remaining = len(job.prompt) - job.fed
                if remaining <= 0 or budget <= 0 or job.cancelled:
                    continue
                take = min(remaining, budget)
                if take == remaining > 1 and decoding and job.fed:
                    # The last chunk of a prompt ingested over several steps: its
                    # last token computes logits and samples, as a decoding
                    # sequence does, and the step leaves room for that. (A prompt
                    # that fits one step goes whole: its first token comes first.)
                    room = budget - self.budget.output_tokens(len(decoding))
                    if room < remaining:
                        take = min(remaining - 1, max(1, room))
                budget -= take
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
            for job, take in parts:
                assert job.seq is not None
                start = len(job.seq.tokens)
                if job.fed >= len(job.prompt):
                    assert job.next_token is not None
                    plan.append((job, 1, batch.add(job.next_token, start, job.seq.index, True)))
                    continue
                index = -1
                for k in range(take):
                    last = job.fed + k == len(job.prompt) - 1
                    i = batch.add(job.prompt[job.fed + k], start + k, job.seq.index, last)
                    if last:
                        index = i
                plan.append((job, take, index))
        if not plan:
            return
        self._doing = (f"decoding a batch of {batch.n} token(s) for {len(plan)} sequence(s)", "")
        if self.on_prefill is not None:
            for job in first_chunks:
                self.on_prefill(job.request.id, len(job.prompt))
        self.stats["steps"] += 1
        self.stats["max_batch_sequences"] = max(self.stats["max_batch_sequences"], len(plan))
        started = time.perf_counter()
        status = llama_cpp.llama_decode(self.ctx, batch.ready())
        decoded = time.perf_counter()
        self.seconds["decode"] += decoded - started
        prompt_tokens = batch.n - len(decoding)
        with self._cond:
            for job, _, _ in plan:
                job.in_flight = False
            aborted = self.flag.raised
            self.flag.lower()
        if status != 0:
            # Back to where every sequence was before this step: llama.cpp kept
            # the micro-batches it finished, and they go too.
            for job, _, _ in plan:
                assert job.seq is not None
                llama_cpp.llama_memory_seq_rm(self._memory, job.seq.index, len(job.seq.tokens), -1)
            if status == 2 or aborted:
                self.stats["aborts"] += 1
                for job, _, _ in plan:
                    if job.cancelled:
                        job.stats.aborted = True
                return  # the survivors run their part again next step
            log.error("llama_decode returned %d for a batch of %d tokens", status, batch.n)
            for job, _, _ in plan:
                self._fail(job, "the model failed while generating")
            return
        for job, fed, index in plan:
            assert job.seq is not None
            if job.fed < len(job.prompt):
                job.seq.tokens.extend(job.prompt[job.fed : job.fed + fed])
                job.fed += fed
                job.stats.decoded += fed
                self.stats["prompt_tokens_decoded"] += fed
                if job.fed == len(job.prompt) and not job.cancelled:
                    job.sink.prompt_processed(len(job.prompt), job.stats.reused)
            else:
                assert job.next_token is not None
                job.seq.tokens.append(job.next_token)
                job.next_token = None
            if index >= 0 and not job.cancelled:
                self._sample(job, index)
        ended = time.perf_counter()
        self.seconds["sample"] += ended - decoded
        # The budget sizes what the decoding sequences wait for: the whole step.
        self.budget.observe(len(decoding), prompt_tokens, ended - begun)
        self.step_log.append((len(decoding), prompt_tokens, share, ended - begun))

    def _prefilling(self) -> bool:
        return any(j.fed < len(j.prompt) and not j.cancelled for j in self._jobs)

    def _sample(self, job: Job, index: int) -> None:
        assembler = job.assembler
        assert assembler is not None
        budget = job.budget
        if budget is not None and not job.forced and budget.exhausted():
            job.forced.extend(self.reasoning_close)
        if job.forced:
            token = self._force(job)
        elif job.argmax:
            # What the greedy sampler picks (the first of the highest logits),
            # without writing a 262,144-entry candidate list first.
            logits = llama_cpp.llama_get_logits_ith(self.ctx, index)
            token = int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.n_vocab,))))
        elif job.grammar is None:
            token = llama_cpp.llama_sampler_sample(job.sampler, self.ctx, index)
        else:
            self._doing = ("sampling under its grammar", job.request.id)
            try:
                constrained = self._constrained_token(job, index)
            except _GivenUp as exc:
                if not job.cancelled:
                    self._fail(job, str(exc), code="unsupported_option")
                return
            if job.cancelled:
                return  # the next step's cancels let it go
            if constrained is None:
                self._fail(job, "the grammar allows no token here", code="internal")
                return
            token = constrained
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            self._ending(job, "stop")
        else:
            job.produced += 1
            entries: tuple[TokenLogprob, ...] = ()
            if job.request.logprobs is not None:
                # Only for the sequences that asked, from the raw logits
                # (which sampling read but did not change).
                logits = llama_cpp.llama_get_logits_ith(self.ctx, index)
                entries = (self.logprobs.entry(logits, token, job.request.logprobs),)
            text = assembler.feed(self._piece(token))
            job.outbox.append((text, 1, entries))
            if budget is not None:
                budget.feed(text)
            if assembler.stopped:
                job.ending = Outcome(
                    "stop",
                    len(job.prompt),
                    job.produced,
                    cached_tokens=job.stats.reused,
                    stop_sequence=assembler.stop_string,
                )
            elif job.produced >= job.max_tokens:
                self._ending(job, "length")
            else:
                job.next_token = token
        self._deliver(job)

    def _force(self, job: Job) -> int:
        """The next of the close tag's tokens, in place of a sampled one. The
        sampler chains see it as if sampled (their penalty and DRY history);
        a grammar does not, as it constrains the answer, not the think block."""
        token = job.forced.popleft()
        if job.pre is not None:
            llama_cpp.llama_sampler_accept(job.pre, token)
        if job.sampler is not None:
            llama_cpp.llama_sampler_accept(job.sampler, token)
        job.stats.forced += 1
        return token

    def _constrained_token(self, job: Job, index: int) -> int | None:
        """:meth:`_sample_constrained` on the grammar worker, waited for at most
        :attr:`grammar_deadline_s` and not after a cancel: then the worker is
        given up on (it keeps what it uses) and ``_GivenUp`` raised."""
        candidates = self._candidates
        candidates.snapshot(llama_cpp.llama_get_logits_ith(self.ctx, index))
        worker = self._worker
        worker.start(functools.partial(self._sample_constrained, job, candidates))
        deadline = time.monotonic() + self.grammar_deadline_s
        with self._cond:
            while not worker.done and not job.cancelled:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        if worker.done:
            result: int | None = worker.result()
            return result
        # The samplers go with the worker: it frees them when its call returns.
        samplers = (job.grammar, job.pre, job.sampler)
        job.grammar = job.pre = job.sampler = None
        worker.abandon(functools.partial(_free_all, samplers), overdue=not job.cancelled)
        self._abandoned.append(worker)
        self._worker = GrammarWorker(self._cond)
        self._candidates = candidates.fresh()
        self.stats["grammar_abandoned"] += 1
        if job.cancelled:
            raise _GivenUp("cancelled")
        log.error(
            "id=%s its grammar's work for one token exceeded %.0f ms: the request ends, "
            "and the native call goes on on its own thread (a core stays busy until it "
            "returns; %d such call(s) now)",
            job.request.id,
            self.grammar_deadline_s * 1000,
            self.grammar_calls_running(),
            extra=context(job.request.conn_id, job.request.id),
        )
        raise _GivenUp(
            f"the grammar took more than {self.grammar_deadline_s * 1000:.0f} ms of work for one "
            "token (backend.llama.grammar_deadline_ms): it is too ambiguous for llama.cpp's "
            "grammar engine (simplify it: fewer nested optional or repeated parts)"
        )

    def _sample_constrained(self, job: Job, candidates: Candidates) -> int | None:
        """Sample, then let the grammar check the token; when it rejects it,
        sample again from what the grammar allows (see :mod:`.llama_grammar`).
        Runs on the grammar worker, on ``candidates`` (the logits snapshotted)."""
        inside = job.utf8_needed > 0
        candidates.load(inside=inside)
        if job.pre is not None:
            llama_cpp.llama_sampler_apply(job.pre, candidates.full.pointer)
        llama_cpp.llama_sampler_apply(job.sampler, candidates.full.pointer)
        token = candidates.full.selected()
        if not candidates.accepts(job.grammar, token, inside=inside):
            if job.cancelled:
                return None  # the engine drops the request: no more work for it
            candidates.load(inside=inside)
            if job.pre is not None:
                llama_cpp.llama_sampler_apply(job.pre, candidates.full.pointer)
            self.stats["grammar_rejections"] += 1
            if self.exact_filter:
                llama_cpp.llama_sampler_apply(job.grammar, candidates.full.pointer)
                chosen = candidates.full
                self.stats["grammar_tokens_asked"] += self.n_vocab
            else:
                candidates.constrain(job.grammar, inside=inside, top=job.keeps)
                chosen = candidates.short
                self.stats["grammar_tokens_asked"] += candidates.asked
            llama_cpp.llama_sampler_apply(job.sampler, chosen.pointer)
            token = chosen.selected()
            if not candidates.accepts(job.grammar, token, inside=inside):
                return None  # a grammar no token of this vocabulary can continue
        if not llama_cpp.llama_vocab_is_eog(self._vocab, token):
            llama_cpp.llama_sampler_accept(job.grammar, token)
            job.utf8_needed = utf8_needed(job.utf8_needed, self._piece(token))
        if job.pre is not None:
            llama_cpp.llama_sampler_accept(job.pre, token)
        llama_cpp.llama_sampler_accept(job.sampler, token)
        return token

    def _ending(self, job: Job, reason: DoneReason) -> None:
        assert job.assembler is not None
        # A character cut off by max_tokens is dropped, as create_completion drops it.
        tail = job.assembler.flush()
        if tail:
            job.outbox.append((tail, 0, ()))
        job.ending = Outcome(reason, len(job.prompt), job.produced, cached_tokens=job.stats.reused)

    # ------------------------------------------------------------ delivery and ends

    def _deliver(self, job: Job) -> None:
        """Hand the job's held text to its channel; pause it on a full one."""
        while job.outbox:
            text, tokens, entries = job.outbox[0]
            taken = (
                job.sink.offer(text, tokens, entries) if entries else job.sink.offer(text, tokens)
            )
            if not taken:
                if job.cancelled or job.cancel.is_set():
                    return
                with self._cond:
                    job.waiting_room = True
                job.sink.when_room(functools.partial(self._on_room, job))
                return
            job.outbox.popleft()
        if job.ending is not None:
            job.sink.end(job.ending)
            self._leave(job)

    def _fail(self, job: Job, message: str, *, code: Any = "internal") -> None:
        job.sink.end(Outcome(reason="error", error_code=code, error_message=message))
        if job.seq is not None:  # its cells may be half-written: never reused
            llama_cpp.llama_memory_seq_rm(self._memory, job.seq.index, -1, -1)
            job.seq.tokens.clear()
        self._leave(job)

    def _leave(self, job: Job) -> None:
        """The request is over: free its sequence (its cells stay cached) and its slot."""
        if job.on_cancel is not None:
            job.cancel.remove_callback(job.on_cancel)
        self._free_sampler(job)
        if job.seq is not None:
            job.seq.job = None
        if job in self._jobs:
            self._jobs.remove(job)
        job.submission.complete()

    @staticmethod
    def _free_sampler(job: Job) -> None:
        _free_all((job.sampler, job.pre, job.grammar))
        job.sampler = job.pre = job.grammar = None


class _GivenUp(Exception):
    """A sequence's grammar work was given up on (its deadline, or its cancel)."""


def _free_all(samplers: tuple[Any, ...]) -> None:
    for sampler in samplers:
        if sampler is not None:
            llama_cpp.llama_sampler_free(sampler)

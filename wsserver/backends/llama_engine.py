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

The engine keeps the loop — cancels, admission, the decode, the text and
its delivery — and a part for each other concern: the sequences' cells
(:class:`~.llama_sequences.PromptCache`), a request's setup
(:class:`~.llama_intake.Intake`), what a step decodes (:class:`~.llama_batching.Batcher`),
images (:class:`~.llama_vision.ImageDecoder`), sampling
(:class:`~.llama_samplers.Samplers`), liveness (:class:`~.llama_liveness.StepWatch`).

One step:

1. **Cancels first.** A cancelled request leaves at once (the client had its
   ``done`` from the core); its sequence keeps exactly the cells that were
   committed (the prompt cache: :mod:`.llama_sequences`).
2. **Admission.** New requests are tokenized here (off the loop) and given a
   free sequence, preferably one whose cells hold the start of the prompt,
   or the lowest free one with a state kept in host memory restored into it
   (:mod:`.llama_host_cache`); only the rest is prefilled (:mod:`.llama_intake`).
3. **One batch.** The next token of every decoding sequence whose text was
   delivered, plus prompt tokens (or an image's embeddings) of prefilling
   sequences within a time budget while others decode, so a long prompt does
   not freeze them (:mod:`.llama_batching`). A sequence whose channel refused
   its last text (a slow client) sits out, holding that token's text, until
   ``when_room`` fires: its memory stays bounded, the others keep their pace.
   A decoding sequence may add an n-gram draft (:mod:`.llama_speculation`).
4. **Decode**, then sample every sequence that asked for logits with its own
   native sampler chain (and grammar: :mod:`.llama_samplers`), at each draft
   token too while the draft holds (:func:`.llama_batching.verify`); its
   :class:`~wsserver.core.textstream.TextAssembler` makes the text (UTF-8, stop
   strings); EOG, a stop string or ``max_tokens`` (its context's room) end it.
   Then embedding work, within the budget's room (:mod:`.llama_embed`).

The reasoning budget (the close tag's tokens taken instead of sampled) and
cancel during a decode (the native abort flag, the cells rolled back):
docs/llama.md.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import llama_cpp

from ..core.logprobs import TokenLogprob
from ..errors import BackendError
from .base import CancelEvent, GenerationRequest, Outcome, Sink, Submission
from .llama_batching import Batcher, decoding, embed_room, verify
from .llama_choices import Choices
from .llama_context import AbortFlag, quiet_errors
from .llama_embed import Embedder
from .llama_grammar import GrammarCache
from .llama_host_cache import CacheCounters, HostCache
from .llama_intake import Drafting, Intake, Prepare
from .llama_liveness import StepWatch
from .llama_logprobs import LogprobReader
from .llama_samplers import GivenUp, Samplers
from .llama_sequences import Job, PromptCache, RequestStats, engine_counters
from .llama_vision import ImageDecoder

__all__ = ["BatchEngine", "RequestStats"]

log = logging.getLogger("wsserver.llama")

#: Per-request counters kept for tests and the bench, newest last.
_STATS_KEPT = 256


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
        prefill_gap_ms: float = 0.0,
        piece: Callable[[int], bytes],
        read_piece: Callable[[int], bytes] | None = None,
        tokenize_text: Callable[[str], list[int]] | None = None,
        native_abort: bool = True,
        reasoning_close: tuple[int, ...] = (),
        opens_reasoning: Callable[[GenerationRequest], bool] | None = None,
        grammar_deadline_s: float = 1.0,
        stall_s: float = 30.0,
        prompt_cache_bytes: int = 0,
        cache_counters: CacheCounters | None = None,
        images: ImageDecoder | None = None,
        drafting: Drafting | None = None,
    ) -> None:
        self.ctx = ctx
        self._vocab = vocab
        #: Prompt + completion per sequence: what was asked, within what llama.cpp made.
        self.n_ctx = min(n_ctx, llama_cpp.llama_n_ctx_seq(ctx))
        self.n_batch = n_batch
        #: The batch, the prompt's budget in it, the latest steps.
        self.batcher = Batcher(
            n_batch=n_batch,
            parallel=parallel,
            prefill_chunk=prefill_chunk,
            prefill_budget=prefill_budget,
            prefill_gap_ms=prefill_gap_ms,
            log_size=4 * _STATS_KEPT,
            draft_max=drafting.draft_max if drafting is not None else 0,
        )
        self._piece = piece
        #: The tokens that close a think block whose budget is spent, and
        #: whether a request's prompt opened the block (see the module docstring).
        self.reasoning_close = reasoning_close
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(vocab)
        self.grammars = GrammarCache(vocab)
        self.logprobs = LogprobReader(self.n_vocab, piece)
        self._cond = threading.Condition(threading.RLock())
        self.stats = engine_counters()
        #: Every sequence's sampler chain, and the grammar work around it.
        self.samplers = Samplers(
            ctx=ctx,
            vocab=vocab,
            n_vocab=self.n_vocab,
            n_ctx=self.n_ctx,
            piece=piece,
            read_piece=read_piece,
            tokenize_text=tokenize_text,
            changed=self._cond,
            grammar_deadline_s=grammar_deadline_s,
            stats=self.stats,
        )
        #: The sequences and the KV cells each holds (the prompt cache), and
        #: the states kept beyond them in host memory, up to ``prompt_cache_bytes``.
        host = (
            HostCache(ctx, prompt_cache_bytes, cache_counters) if prompt_cache_bytes > 0 else None
        )
        self.cache = PromptCache(ctx, parallel, host)
        self.intake = Intake(
            prepare=prepare,
            n_ctx=self.n_ctx,
            cache=self.cache,
            grammars=self.grammars,
            samplers=self.samplers,
            reasoning_close=reasoning_close,
            opens_reasoning=opens_reasoning,
            stats=self.stats,
            drafting=drafting,
        )
        self.flag = AbortFlag(ctx, native=native_abort)
        self.images = images  # a vision model's image encoder and decoder (None: text only)
        #: Liveness: when the running step began, what it is doing now, and
        #: after how long a step counts as stalled.
        self.watch = StepWatch(stall_s)
        self._incoming: list[Job] = []
        #: A prompt's several choices share its cells (:mod:`.llama_choices`).
        self.choices = Choices(self.intake, self._cond, self._fail, self.stats)
        self._jobs: list[Job] = []  # admitted, in admission order
        self._stopping = False
        #: Seconds spent in ``llama_decode`` and in sampling + text, for the benchmark.
        self.seconds: dict[str, float] = {"decode": 0.0, "sample": 0.0}
        self.request_stats: dict[str, RequestStats] = {}
        #: Called on the engine thread before a request's first prompt tokens are
        #: decoded (abort flag armed), with its ID and prompt length; must not raise.
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
        """Run ``embedder``'s work on this thread after each step's decode (:mod:`.llama_embed`)."""
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
        """Stop the step loop and free what it holds. False: the engine thread did
        not end within ``timeout`` (stuck in a native call), or a grammar call given up
        on still runs — nothing native was freed, nor may the model be (leaked till exit)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the engine did not stop (it is %s): its memory left", self.watch.describe())
            return False
        self.samplers.close()
        for job in self._jobs:
            self.samplers.free(job)
        self.batcher.free()
        if self.cache.host is not None:
            self.cache.host.clear()
        if (running := self.grammar_calls_running()) > 0:
            log.error("%d grammar call(s) given up on still run: the model's memory left", running)
            return False
        self.grammars.close()
        return True

    # ------------------------------------------------------------ liveness
    def grammar_calls_running(self) -> int:
        """Grammar calls given up on whose native call still runs (a core each)."""
        return self.samplers.calls_running()

    def step_seconds(self) -> float:
        """How long the running step has lasted so far (0: between steps, idle)."""
        return self.watch.seconds()

    def stalled(self) -> str | None:
        """Why the engine is stalled (a step ran ``stall_s`` or more), or None; logged at ERROR once."""
        return self.watch.stalled(self._jobs)

    # ------------------------------------------------------------ the loop

    def _runnable(self) -> bool:
        if self.embedder is not None and self.embedder.runnable():
            return True
        return bool(self._incoming or self._stopping) or any(j.needs_step() for j in self._jobs)

    def _run(self) -> None:
        quiet_errors(self.flag)
        while True:
            with self._cond:
                while not self._runnable():
                    self._cond.wait()
                if self._stopping:
                    return
                incoming, self._incoming = self._incoming, []
            self.watch.begin()
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
            self.watch.end()

    def _step(self, incoming: list[Job]) -> None:
        for job in list(self._jobs):
            if job.cancelled:
                self._leave(job)
        for job in incoming:
            if job.cancelled:
                self._leave(job)
            else:
                self.watch.doing = (
                    "admitting (tokenizing its prompt, compiling its grammar)",
                    job.request.id,
                )
                try:
                    self.choices.admit(job)
                except BackendError as exc:
                    self._fail(job, str(exc), code=exc.code)
                    continue
                self._jobs.append(job)
        # A step as the decoding sequences see it: the last step's tokens go out, the
        # next batch is built, decoded and sampled (admission, once a request: not).
        begun = time.perf_counter()
        for job in list(self._jobs):
            if (job.outbox or job.ending) and not job.waiting_room:
                self._deliver(job)
        self._decode_step(begun)
        if self.embedder is not None:
            self._embed_step(time.perf_counter() - begun)

    def _embed_step(self, spent: float) -> None:
        """Embedding work (:mod:`.llama_embed`): cancels, inputs in the room ``spent`` left."""
        assert self.embedder is not None
        go, room = embed_room(self._jobs, self.batcher.budget, spent, self.embedder.turn_due)
        if not go:
            self.embedder.step(None, decode=False)  # its cancels still go at once
            return
        self.watch.doing = ("embedding inputs", "")
        self.embedder.step(room)

    # ------------------------------------------------------------ one step

    def _decode_step(self, begun: float) -> None:
        batch = self.batcher.batch
        image = self._image_part() if self.images is not None else None
        if image is not None:  # measured apart: the budget learns decode steps, not encodes
            begun = time.perf_counter()
        with self._cond:
            self.flag.lower()
            embedding = self.embedder is not None and self.embedder.runnable()  # takes the room
            turn = embedding and self.embedder is not None and self.embedder.turn_due  # no prompt
            step = self.batcher.plan(self._jobs, image or 0, not embedding, prompts=not turn)
        plan = step.parts
        if not plan:
            return
        self.watch.doing = (
            f"decoding a batch of {batch.n} token(s) for {len(plan)} sequence(s)",
            "",
        )
        if self.on_prefill is not None:
            for job in step.first_chunks:
                self.on_prefill(job.request.id, len(job.prompt))
        self.stats["steps"] += 1
        self.stats["max_batch_sequences"] = max(self.stats["max_batch_sequences"], len(plan))
        started = time.perf_counter()
        status = llama_cpp.llama_decode(self.ctx, batch.ready())
        decoded = time.perf_counter()
        self.seconds["decode"] += decoded - started
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
                self.cache.rollback(job.seq)
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
            if job.commit(fed):
                self.stats["prompt_tokens_decoded"] += fed
                if job.fed == len(job.prompt) and not job.cancelled:
                    job.sink.prompt_processed(len(job.prompt), job.stats.reused)
            if index >= 0:  # (a cancelled job's draft cells go, nothing sampled)
                forks = [] if job.cancelled else self.choices.fork(job, self._jobs, self._incoming)
                verify(job, index, self._sample, self.cache.rollback, self.stats)
                for each in forks:  # its choices: the same logits, their own samplers
                    self._sample(each, index)
        ended = time.perf_counter()
        self.seconds["sample"] += ended - decoded
        # The budget sizes what the decoding sequences wait for: the whole step.
        self.batcher.observe(step, ended - begun)

    def _image_part(self) -> int | None:
        """The oldest due image's embeddings decoded, a prompt share (:mod:`.llama_vision`): how many."""
        job = next((j for j in self._jobs if not j.cancelled and j.image_at()), None)
        span = job.image_at() if job is not None else None
        if self.images is None or job is None or job.seq is None or span is None:
            return None
        if job.embeddings is None:
            self.watch.doing = (f"encoding {span.kind} ({span.n_tokens} embeds)", job.request.id)
            job.embeddings = self.images.encode(span)
            if job.embeddings is None:
                self._fail(job, f"the {span.kind} could not be encoded")
                return 0
            self.stats["images_encoded"] += 1
        offset = job.fed - span.start
        share = self.images.piece(span, self.batcher.budget.share(decoding(self._jobs)))
        count = min(span.n_tokens - offset, share)
        with self._cond:
            if job.cancelled:
                return 0
            self.flag.lower()
            job.in_flight = True
        self.watch.doing = (f"decoding {count} {span.kind} embedding(s)", job.request.id)
        status = self.images.decode(job.embeddings, offset, count, job.seq.index, job.fed)
        with self._cond:
            job.in_flight, aborted = False, self.flag.raised
            self.flag.lower()
        if status == 0:
            self.stats["prompt_tokens_decoded"] += job.commit(count)
            if job.fed == span.start + span.n_tokens:
                job.embeddings = None
            return count
        self.cache.rollback(job.seq)
        if status == 2 or aborted:
            self.stats["aborts"] += 1
            job.stats.aborted = job.cancelled
        else:
            self._fail(job, f"the model failed while reading a {span.kind}")
        return 0

    def _sample(self, job: Job, index: int) -> None:
        budget = job.budget
        if budget is not None and not job.forced and budget.exhausted():
            job.forced.extend(self.reasoning_close)
        if job.forced:
            token = self.samplers.force(job)
        elif job.grammar is None:
            token = self.samplers.sample(job, index)
        else:
            self.watch.doing = ("sampling under its grammar", job.request.id)
            try:
                constrained = self.samplers.constrained(job, index)
            except GivenUp as exc:
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
            job.finish("stop")
        else:
            entries: tuple[TokenLogprob, ...] = ()
            if job.request.logprobs is not None:
                # Only for the sequences that asked, from the raw logits
                # (which sampling read but did not change).
                logits = llama_cpp.llama_get_logits_ith(self.ctx, index)
                entries = (self.logprobs.entry(logits, token, job.request.logprobs),)
            job.produce(token, self._piece(token), entries)
        self._deliver(job)

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
            self.cache.forget(job.seq)
        self._leave(job)

    def _leave(self, job: Job) -> None:
        """The request is over: free its sequence (its cells stay cached) and its slot."""
        if job.on_cancel is not None:
            job.cancel.remove_callback(job.on_cancel)
        self.samplers.free(job)
        if job.seq is not None:  # (a draft's cells past its end go before it completes)
            self.cache.rollback(job.seq)
            job.seq.job = None
        if job in self._jobs:
            self._jobs.remove(job)
        self.choices.left(job)
        job.submission.complete()

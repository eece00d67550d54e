"""Embeddings and rerank scores on the llama engine's thread, beside its streams.

Theory of operation
-------------------
llama.cpp computes embeddings only in a context made for them
(``embeddings = true``) and pools them by the context's pooling type, so an
:class:`Embedder` owns a **second, dedicated context** on the same loaded
model (the weights are shared; only a small KV cache and the compute buffer
are its own), made on the first request that needs it. It is not the
generation context switched with ``llama_set_embeddings``: that one holds the
streams' KV cells and prompt caches, and its pooling is fixed when it is made.

**Pooling.** The GGUF's own (``{arch}.pooling_type``: mean, cls, last, rank);
a model that declares none — a generative model — embeds with **mean**
pooling. A ``rank`` model (a reranker) serves ``/v1/rerank`` and nothing else;
any other serves embeddings and no rerank (:meth:`Embedder.kind`). Vectors
are what the model returns, not normalised — exactly what llama-cpp-python's
``Llama.embed`` returns with the same pooling (the tests compare them).

**Whole inputs.** llama.cpp pools a sequence only when all of its tokens are
in one micro-batch, and an encoder's attention (a non-causal model) needs
them together anyway: an input is decoded whole, never split across steps,
so the longest input is the context's size, ``embed_batch`` tokens
(``backend.llama.embed_batch``; n_ctx = n_batch = n_ubatch of this context).
A longer one is refused (``context_length_exceeded``, with its index) before
it is queued. Several inputs go in one decode, as separate sequences (at most
:data:`MAX_SEQUENCES`), the KV cache cleared before each — a reranker's
pairs one at a time: batched, llama.cpp's rank pooling scored a pair
differently from the same pair alone (by up to 1.3 on the tiny test
reranker; llama-cpp-python's own ``embed`` shows the same).

**Scheduled as a prompt is.** An embedding request holds one of the model's
slots (the same scheduler as generations); its work runs on the engine's one
thread, in the engine's step, *after* the streams' decode
(:meth:`Embedder.step`): while sequences decode it takes whole inputs worth
at most the step's **room** — the time the prefill budget leaves beside their
decode (:meth:`~.llama_budget.PrefillBudget.room`), priced by this
context's own measured cost, a fixed part and a part a token, less a margin
for the overruns of the last decodes (:mod:`.llama_embed_cost`; a generative
model's vocabulary head over every token is ~2x a prompt token on the default
model, unless :mod:`.llama_hidden` ends the decode before it) — and at least
one input, so it always moves; the streams' gap is
their decode plus that room, as beside a prompt. While a prompt is being
prefilled the step is the prompt's (its first token is someone's wait;
embedding is batch work). With nothing decoding it takes what one decode
holds. The bound on the streams' gap is therefore one input's decode at
worst: ``embed_batch`` tokens.

**Cancel.** A cancel marks the request; one in the decode in flight raises
this context's abort flag (ggml stops at its next graph node). Nothing of an
aborted decode is kept — its other inputs simply run again next step.

**Memory.** Bounded before anything runs (the backend's
:meth:`Embedder.prepare`, :mod:`.llama_embed_inputs`): the inputs' count, their
tokens in all, and the vectors' bytes (inputs x dimensions x 4). The vectors
are kept as float32 bytes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import llama_cpp
import numpy as np

from ..core.embedding import Embed, Embedded
from ..errors import ProtocolError
from ..logs import context
from .base import CancelEvent
from .embed_door import EmbedDoor, EmbedSubmission
from .llama_context import AbortFlag, Batch
from .llama_embed_cost import EmbedCost
from .llama_embed_inputs import POOLING_NAMES, gguf_pooling, prepare_inputs

if TYPE_CHECKING:
    from llama_cpp._internals import LlamaModel

__all__ = ["MAX_SEQUENCES", "TURN_AFTER", "EmbedJob", "Embedder"]

log = logging.getLogger("wsserver.llama")

#: Inputs in one decode at most (llama.cpp allows 256 sequences).
MAX_SEQUENCES: Final = 64
#: While prompts are prefilled back to back, waiting embedding work takes
#: every fifth step (the prompts' share goes to it): prompts first, but the
#: work is not starved (docs/embeddings.md).
TURN_AFTER: Final = 4


@dataclass(eq=False)
class EmbedJob:
    """One embedding request on the engine: its inputs' tokens, how far it got."""

    request: Embed
    tokens: tuple[tuple[int, ...], ...]
    cancel: CancelEvent
    submission: EmbedSubmission
    #: Inputs done, in order; their vectors (or scores).
    done: int = 0
    vectors: list[bytes] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    cancelled: bool = False
    #: Has inputs in the decode in flight (a cancel then aborts it).
    in_flight: bool = False
    on_cancel: Any = None


class Embedder(EmbedDoor):
    """A model's embedding context and queue, stepped by its engine thread:
    the loaded model's embedding door (:mod:`.embed_door`)."""

    def __init__(
        self,
        *,
        model: LlamaModel,
        name: str,
        batch_tokens: int,
        n_threads: int,
        native_abort: bool = True,
    ) -> None:
        #: The loaded model (its tokenizer); ``_model`` is its llama.cpp handle.
        self.llama_model = model
        self._model = model.model
        self._name = name
        #: The longest input, and the most tokens one decode holds.
        self.batch_tokens = batch_tokens
        self._n_threads = n_threads
        self._native_abort = native_abort
        self.pooling = gguf_pooling(self._model)
        self.n_embd: int = llama_cpp.llama_model_n_embd(self._model)
        self._cond: threading.Condition = threading.Condition(threading.RLock())
        self._incoming: list[EmbedJob] = []
        self._jobs: deque[EmbedJob] = deque()
        self._ctx: Any = None
        self._batch: Any = None  # a Batch while the context is open
        #: Held while the context is made or freed (a worker thread, the unload).
        self._open_lock = threading.Lock()
        self._closed = False
        #: Decodes to run one input each (after a NaN in a decode of several).
        self._solo = 0
        self._flag: AbortFlag | None = None
        #: What a decode of this context costs (:mod:`.llama_embed_cost`).
        self.cost = EmbedCost()
        #: Decodes, inputs and tokens embedded, aborted decodes (tests, the bench).
        self.stats: dict[str, int] = {"decodes": 0, "inputs": 0, "tokens": 0, "aborts": 0}
        #: The latest decodes: (inputs, tokens, the room it was given or -1 (none
        #: decoding beside it), the seconds it was priced at or -1, seconds).
        self.step_log: deque[tuple[int, int, float, float, float]] = deque(maxlen=1024)
        #: Steps in a row that passed its waiting work over — a prompt's, or one
        #: with no room left beside the streams (:attr:`turn_due`).
        self.passed_over = 0
        #: Called on the engine thread just before each decode, with the ids of
        #: the requests in it (tests); quick, must not raise.
        self.on_decode: Callable[[list[str]], None] | None = None

    @property
    def kind(self) -> str:
        """``rerank`` for a rank model (pooling rank), else ``embed``."""
        return "rerank" if self.pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK else "embed"

    def bind(self, cond: threading.Condition) -> None:
        """Share the engine's condition: a new job or a cancel wakes its thread."""
        self._cond = cond

    # ------------------------------------------------------------ loop side

    def prepare(self, request: Embed) -> Embed:
        """Tokenize and check ``request``'s inputs (on a worker thread):
        :func:`.llama_embed_inputs.prepare_inputs`."""
        prepared = prepare_inputs(
            request,
            model=self.llama_model,
            pooling=self.pooling,
            n_embd=self.n_embd,
            batch_tokens=self.batch_tokens,
            name=self._name,
        )
        # The context is made here, on this worker thread, not on the engine's:
        # llama.cpp allocates its buffers (270 MiB for the default model) and
        # the streams would wait for it — measured, a 1.8-2.2 s gap.
        try:
            self._ensure_open()
        except Exception as exc:
            log.error("cannot make the embedding context: %s", exc)
            raise ProtocolError(
                "internal", "the model's embedding context could not be made", request.id
            ) from None
        return prepared

    def start(self, request: Embed, *, cancel: CancelEvent) -> EmbedSubmission:
        if not request.tokenized:
            submission = EmbedSubmission()
            submission.fail("internal", "the request was not prepared for this model")
            return submission
        tokens = tuple(t for t in request.inputs if isinstance(t, tuple))
        job = EmbedJob(request, tokens, cancel, EmbedSubmission())
        with self._cond:
            self._incoming.append(job)
            self._cond.notify()
        job.on_cancel = functools.partial(self._on_cancel, job)
        cancel.add_callback(job.on_cancel)
        return job.submission

    def _on_cancel(self, job: EmbedJob) -> None:
        with self._cond:
            job.cancelled = True
            if job.in_flight and self._flag is not None:
                self._flag.raise_()
            self._cond.notify()

    # ------------------------------------------------------------ engine side

    @property
    def turn_due(self) -> bool:
        """Whether waiting work takes the next step from prompts being prefilled
        back to back: it was passed over :data:`TURN_AFTER` steps in a row
        (:func:`.llama_batching.embed_room`). It waits; it does not starve."""
        return self.passed_over >= TURN_AFTER

    def runnable(self) -> bool:
        """Work to do (called under the engine's condition)."""
        return bool(self._incoming or self._jobs)

    def step(self, room_s: float | None, *, decode: bool = True) -> None:
        """Take new requests, let cancelled ones go, then (``decode``) one
        decode of whole inputs: worth at most ``room_s`` seconds (at least one
        input), or (None: nothing decodes beside it) what one decode holds.
        Called on the engine thread every step — also those it may not decode
        in (a prompt's), so that a cancel ends its request within a step."""
        with self._cond:
            incoming, self._incoming = self._incoming, []
        self._jobs.extend(incoming)
        for job in list(self._jobs):
            if job.cancelled:
                self._leave(job)
        self.passed_over = self.passed_over + 1 if self._jobs and not decode else 0
        if not self._jobs or not decode:
            return
        if self._ctx is None:  # prepared before an unload's close: not made yet
            try:
                self._ensure_open()
            except Exception as exc:
                log.error("cannot make the embedding context: %s", exc)
                for job in list(self._jobs):
                    self._fail(job, "internal", "the model's embedding context could not be made")
                return
        self._work(room_s)

    def _work(self, room_s: float | None) -> None:
        """One decode of whole inputs (see :meth:`step`)."""
        self._decode(self._pick(room_s), room_s)

    def _pick(self, room_s: float | None) -> list[tuple[EmbedJob, int]]:
        """The inputs of this decode, oldest request first: (job, input index)."""
        picked: list[tuple[EmbedJob, int]] = []
        tokens = 0
        # Unmeasured beside streams: one input prices the decodes after it.
        fits = None if room_s is None else self.cost.tokens_within(room_s, self.batch_tokens)
        # A reranker's pairs one a decode: llama.cpp's rank pooling gave other
        # scores for a pair batched with others (docs/embeddings.md).
        rank = self.pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK
        most = 1 if rank or self._solo > 0 else MAX_SEQUENCES
        for job in self._jobs:
            for index in range(job.done, len(job.tokens)):
                n = len(job.tokens[index])
                if picked:
                    if len(picked) >= most or tokens + n > self.batch_tokens:
                        return picked
                    if room_s is not None and (fits is None or tokens + n > fits):
                        return picked
                picked.append((job, index))
                tokens += n
        return picked

    def _decode(self, picked: list[tuple[EmbedJob, int]], room_s: float | None) -> None:
        ctx = self._ctx
        flag = self._flag
        assert ctx is not None and flag is not None
        batch = self._batch
        batch.clear()
        for seq, (job, index) in enumerate(picked):
            for pos, token in enumerate(job.tokens[index]):
                batch.add(token, pos, seq, True)  # every token is an output when embedding
        n = batch.n
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        jobs = [job for job, _ in picked]
        if not self._run_decode(jobs, len(picked), n, room_s):
            return
        rank = self.pooling == llama_cpp.LLAMA_POOLING_TYPE_RANK
        width = 1 if rank else self.n_embd
        self.stats["inputs"] += len(picked)
        self._solo = max(0, self._solo - 1)
        if len(picked) > 1 and not self._all_finite(len(picked), width):
            # One input's NaN reaches the others of its decode (a masked
            # attention weight of 0 times NaN is NaN): none of them is kept,
            # and they run again one a decode, so the refusal names the input
            # that made it.
            self._solo = len(picked)
            return
        for seq, (job, index) in enumerate(picked):
            if job.cancelled or job.submission.done:
                continue
            pointer = llama_cpp.llama_get_embeddings_seq(ctx, seq)
            if not pointer:
                self._fail(job, "internal", "the model gave no embedding")
                continue
            values = np.ctypeslib.as_array(pointer, shape=(width,))
            if not np.isfinite(values).all():
                self._fail(
                    job,
                    "bad_request",
                    f"input {index}: the model produced a value that is not a number "
                    "(NaN or infinity) for it",
                )
                continue
            if rank:
                job.scores.append(float(values[0]))
            else:
                job.vectors.append(values.astype("<f4").tobytes())
            job.done = index + 1
            if job.done == len(job.tokens):
                self._finish(job)

    def _run_decode(
        self,
        jobs: list[EmbedJob],
        inputs: int,
        n: int,
        room_s: float | None,
    ) -> bool:
        """Decode the batch (``n`` tokens of ``inputs`` inputs of ``jobs``)
        under the abort flag, and account for it: True once it succeeded."""
        ctx, flag = self._ctx, self._flag
        assert ctx is not None and flag is not None
        with self._cond:
            flag.lower()
            for job in jobs:
                job.in_flight = True
        if self.on_decode is not None:
            self.on_decode([job.request.id for job in jobs])
        priced = None if room_s is None else self.cost.price(n)
        started = time.perf_counter()
        status = llama_cpp.llama_decode(ctx, self._batch.ready())
        seconds = time.perf_counter() - started
        with self._cond:
            for job in jobs:
                job.in_flight = False
            aborted = flag.raised
            flag.lower()
        self.stats["decodes"] += 1
        if status != 0:
            if status == 2 or aborted:
                self.stats["aborts"] += 1
                return False  # the cancelled leave next step; the others run again
            log.error("llama_decode returned %d for %d embedding input(s)", status, inputs)
            for job in set(jobs):
                self._fail(job, "internal", "the model failed while embedding")
            return False
        self.cost.observe(n, seconds, priced)
        self.stats["tokens"] += n
        self.step_log.append(
            (
                inputs,
                n,
                -1.0 if room_s is None else room_s,
                -1.0 if priced is None else priced,
                seconds,
            )
        )
        return True

    def _all_finite(self, sequences: int, width: int) -> bool:
        for seq in range(sequences):
            pointer = llama_cpp.llama_get_embeddings_seq(self._ctx, seq)
            if pointer and not np.isfinite(np.ctypeslib.as_array(pointer, shape=(width,))).all():
                return False
        return True

    def _finish(self, job: EmbedJob) -> None:
        total = sum(len(t) for t in job.tokens)
        result = Embedded(
            vectors=tuple(job.vectors),
            scores=tuple(job.scores),
            prompt_tokens=total,
            dimensions=0 if job.scores else self.n_embd,
        )
        job.vectors = []
        log.debug(
            "id=%s embedded %d input(s), %d token(s)",
            job.request.id,
            len(job.tokens),
            total,
            extra=context(job.request.conn_id, job.request.id),
        )
        self._leave(job, result=result)

    def _fail(self, job: EmbedJob, code: Any, message: str) -> None:
        job.submission.fail(code, message)
        self._leave(job)

    def _leave(self, job: EmbedJob, result: Embedded | None = None) -> None:
        if job.on_cancel is not None:
            job.cancel.remove_callback(job.on_cancel)
        if job in self._jobs:
            self._jobs.remove(job)
        if result is not None:
            job.submission.finish(result)
        job.submission.complete()

    def fail_all(self, message: str) -> None:
        """The engine failed: end every request (engine thread, or after it stopped)."""
        with self._cond:
            incoming, self._incoming = self._incoming, []
        for job in [*self._jobs, *incoming]:
            self._fail(job, "internal", message)

    # ------------------------------------------------------------ the context

    def decode_tokens(self) -> int:
        """The most tokens one decode holds: a whole input's (llama.cpp pools
        a sequence only when all its tokens are in one micro-batch)."""
        return self.batch_tokens

    def _context_cells(self) -> int:
        """The context's KV cells: one decode's (cleared before each)."""
        return self.batch_tokens

    def _context_pooling(self) -> int:
        """The pooling the context is made with: the model's, llama.cpp pools."""
        return self.pooling

    def _eval_callback(self) -> Any:
        """The context's evaluation callback (``cb_eval``), if any: none here."""
        return None

    def _ensure_open(self) -> None:
        """Make the context once (a worker thread's first ``prepare``); never
        after :meth:`close`."""
        with self._open_lock:
            if self._closed:
                raise RuntimeError("the model was unloaded")
            if self._ctx is None:
                self._open()

    def _open(self) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self._context_cells()
        params.n_batch = self.decode_tokens()
        params.n_ubatch = self.decode_tokens()
        params.n_seq_max = MAX_SEQUENCES
        # One KV stream for every sequence: split streams gave vectors far from
        # llama-cpp-python's here (docs/embeddings.md); the cache is cleared
        # before each decode anyway.
        params.kv_unified = True
        params.embeddings = True
        params.pooling_type = self._context_pooling()
        # Off, as in llama_cpp.Llama: on, the default model's vectors moved by
        # up to 0.8 (of components ~5) from the reference's (docs/embeddings.md).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = self._n_threads
        params.n_threads_batch = self._n_threads
        params.no_perf = True
        callback = self._eval_callback()
        if callback is not None:
            params.cb_eval = callback
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if ctx is None:
            raise RuntimeError("llama_init_from_model failed")
        self._ctx = ctx
        self._batch = Batch(self.decode_tokens())
        self._flag = AbortFlag(ctx, native=self._native_abort)
        log.info(
            "embedding context ready: %s pooling, inputs of up to %d tokens, %d dimensions",
            POOLING_NAMES.get(self.pooling, str(self.pooling)),
            self.batch_tokens,
            self.n_embd,
        )

    def close(self) -> None:
        """Free the context (after the engine thread stopped)."""
        self.fail_all("the model was unloaded")
        with self._open_lock:  # not while a worker thread makes it
            self._closed = True
            if self._batch is not None:
                self._batch.free()
                self._batch = None
            if self._ctx is not None:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None

"""The batched engine's samplers: each sequence's next token (used by :mod:`.llama_engine`).

:class:`Samplers` builds a request's native sampler chain when the engine
admits it (:meth:`Samplers.attach`, the prompt fed to its penalties and DRY
as llama-server does), frees it when the request leaves, and picks each
sequence's next token from the position the step decoded for it: a plain
greedy request takes the logits' argmax, which is what its chain would pick,
without the chain's pass over a full candidate list; any other request
without a grammar runs its chain; a constrained one runs its chain around
its grammar, the grammar checking the sampled token first
(:mod:`.llama_grammar`); a think block whose budget is spent takes the close
tag's tokens instead (:meth:`Samplers.force`).

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
(:meth:`Samplers.calls_running`), and the model is not freed under it (the
engine's ``close``).
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np

from ..errors import BackendError
from ..logs import context
from .base import GenerationRequest
from .grammar_worker import GrammarWorker
from .llama_context import chain_keeps, has_history, new_sampler, penalty_window
from .llama_grammar import Candidates, utf8_needed
from .llama_sequences import Job

__all__ = ["GivenUp", "Samplers"]

log = logging.getLogger("wsserver.llama")


class GivenUp(Exception):
    """A sequence's grammar work was given up on (its deadline, or its cancel)."""


class Samplers:
    """Every sequence's sampler chain and the grammar work around it (see
    the module docstring). Used on the engine thread; ``changed`` is the
    engine's condition, which a cancel and the grammar worker notify."""

    def __init__(
        self,
        *,
        ctx: Any,
        vocab: Any,
        n_vocab: int,
        n_ctx: int,
        piece: Callable[[int], bytes],
        read_piece: Callable[[int], bytes] | None,
        tokenize_text: Callable[[str], list[int]] | None,
        changed: threading.Condition,
        grammar_deadline_s: float,
        stats: dict[str, int],
    ) -> None:
        self._ctx = ctx
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._n_ctx = n_ctx
        self._piece = piece
        self._tokenize_text = tokenize_text
        self._changed = changed
        #: The engine's counters, which the grammar work adds to.
        self._stats = stats
        #: The candidate lists of constrained sequences. Built here, with the
        #: model (a pass over the vocabulary: ~1 s for 262,144 tokens), not at
        #: the first constrained request, where it would stall every stream.
        #: ``read_piece``: ``piece`` uncached, so that pass fills no cache.
        self._candidates = Candidates(vocab, n_vocab, read_piece or piece)
        #: Filter by the grammar over the whole vocabulary, as llama.cpp's
        #: common sampler does, instead of :meth:`.Candidates.constrain`'s
        #: shortcut — the reference the tests compare the shortcut with.
        self.exact_filter = False
        #: A sequence's grammar work, this long at most per step (see the
        #: module docstring, "Grammar work and its deadline").
        self.grammar_deadline_s = grammar_deadline_s
        self._worker = GrammarWorker(changed)
        #: Workers given up on whose native call may still run (they end by themselves).
        self._abandoned: list[GrammarWorker] = []

    # ------------------------------------------------------------ a request's chain

    def logit_bias(self, request: GenerationRequest) -> list[tuple[int, float]]:
        """The request's ``logit_bias`` as token ids: a text's tokens each get
        its bias (llama-server's extension). Raises ``BackendError``
        (``bad_request``) for an id outside the vocabulary."""
        out: list[tuple[int, float]] = []
        for key, value in request.sampling.logit_bias:
            if isinstance(key, int):
                if not 0 <= key < self._n_vocab:
                    raise BackendError(
                        f"logit_bias: token {key} is not in the model's vocabulary "
                        f"(ids 0 to {self._n_vocab - 1})",
                        code="bad_request",
                    )
                out.append((key, value))
            elif self._tokenize_text is not None:
                out.extend((token, value) for token in self._tokenize_text(key))
        return out

    def attach(self, job: Job, prompt: list[int], bias: list[tuple[int, float]]) -> None:
        """Build the job's sampler chain (around its grammar, if it has one)
        and feed it the end of ``prompt`` if it keeps a history."""
        request = job.request
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
            n_vocab=self._n_vocab,
            n_ctx=self._n_ctx,
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
                penalty_window(sampling.repeat_last_n, self._n_ctx) if sampling.penalties else 0,
                penalty_window(sampling.dry_penalty_last_n, self._n_ctx) if sampling.dry else 0,
            )
            history = job.sampler if job.grammar is None else job.pre
            for token in prompt[max(0, len(prompt) - window) :]:
                if token >= 0:  # an image's positions are not tokens (llama_vision)
                    llama_cpp.llama_sampler_accept(history, token)

    @staticmethod
    def free(job: Job) -> None:
        """Free the job's sampler chain and grammar."""
        _free_all((job.sampler, job.pre, job.grammar))
        job.sampler = job.pre = job.grammar = None

    # ------------------------------------------------------------ a token

    def force(self, job: Job) -> int:
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

    def sample(self, job: Job, index: int) -> int:
        """The token of an unconstrained job from the logits at ``index``."""
        if job.argmax:
            # What the greedy sampler picks (the first of the highest logits),
            # without writing a 262,144-entry candidate list first.
            logits = llama_cpp.llama_get_logits_ith(self._ctx, index)
            return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self._n_vocab,))))
        token: int = llama_cpp.llama_sampler_sample(job.sampler, self._ctx, index)
        return token

    def constrained(self, job: Job, index: int) -> int | None:
        """:meth:`_sample_constrained` on the grammar worker, waited for at most
        :attr:`grammar_deadline_s` and not after a cancel: then the worker is
        given up on (it keeps what it uses) and :class:`GivenUp` raised."""
        candidates = self._candidates
        candidates.snapshot(llama_cpp.llama_get_logits_ith(self._ctx, index))
        worker = self._worker
        worker.start(functools.partial(self._sample_constrained, job, candidates))
        deadline = time.monotonic() + self.grammar_deadline_s
        with self._changed:
            while not worker.done and not job.cancelled:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
        if worker.done:
            result: int | None = worker.result()
            return result
        # The samplers go with the worker: it frees them when its call returns.
        samplers = (job.grammar, job.pre, job.sampler)
        job.grammar = job.pre = job.sampler = None
        worker.abandon(functools.partial(_free_all, samplers), overdue=not job.cancelled)
        self._abandoned.append(worker)
        self._worker = GrammarWorker(self._changed)
        self._candidates = candidates.fresh()
        self._stats["grammar_abandoned"] += 1
        if job.cancelled:
            raise GivenUp("cancelled")
        log.error(
            "id=%s its grammar's work for one token exceeded %.0f ms: the request ends, "
            "and the native call goes on on its own thread (a core stays busy until it "
            "returns; %d such call(s) now)",
            job.request.id,
            self.grammar_deadline_s * 1000,
            self.calls_running(),
            extra=context(job.request.conn_id, job.request.id),
        )
        raise GivenUp(
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
            self._stats["grammar_rejections"] += 1
            if self.exact_filter:
                llama_cpp.llama_sampler_apply(job.grammar, candidates.full.pointer)
                chosen = candidates.full
                self._stats["grammar_tokens_asked"] += self._n_vocab
            else:
                candidates.constrain(job.grammar, inside=inside, top=job.keeps)
                chosen = candidates.short
                self._stats["grammar_tokens_asked"] += candidates.asked
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

    # ------------------------------------------------------------ the grammar worker

    def calls_running(self) -> int:
        """Grammar computations given up on (their request ended) whose native
        call still runs, each keeping a core busy."""
        self._abandoned = [w for w in self._abandoned if w.alive()]
        return len(self._abandoned)

    def close(self) -> None:
        """Stop the grammar worker (one given up on ends by itself)."""
        self._worker.close()


def _free_all(samplers: tuple[Any, ...]) -> None:
    for sampler in samplers:
        if sampler is not None:
            llama_cpp.llama_sampler_free(sampler)

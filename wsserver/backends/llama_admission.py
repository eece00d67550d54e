"""What the llama backend checks of a request before it is accepted.

:func:`admit` runs, on a loaded model, everything that could otherwise fail
after the request started — so that the client gets its refusal first,
before an HTTP response's head (and its status): the request's grammar or
JSON schema and the grammar of its tool calls compile (cached); the grammar
engine has room for new work (:data:`MAX_ABANDONED_GRAMMAR_CALLS`); its logit
bias names tokens of the vocabulary; its chat template accepts it
(:meth:`~.llama_chat.LlamaChat.check`); and its prompt fits the context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ..core.protocol import Generate
from ..errors import CONTEXT_LENGTH_EXCEEDED, BackendError, ProtocolError
from .llama_chat import LlamaChat
from .llama_engine import BatchEngine
from .request import GenerationRequest

__all__ = ["MAX_ABANDONED_GRAMMAR_CALLS", "admit"]

#: Grammar computations given up on (past their deadline) that may still run
#: natively, each keeping a core busy, before new constrained requests are
#: refused: without a cap, repeating a grammar that the bounds cannot tell
#: from a fair one could tie up every core. One is already half this
#: machine class's cores; a constrained request is refused as ``overloaded``
#: (503: try again) only until that computation returns.
MAX_ABANDONED_GRAMMAR_CALLS: Final = 1

#: A request's prompt tokens (and stop strings), as the engine will feed them.
Prompt = Callable[[GenerationRequest], tuple[list[int], tuple[str, ...]]]


def admit(frame: Generate, *, engine: BatchEngine, chat: LlamaChat, prompt: Prompt) -> None:
    """Refuse ``frame`` now (:class:`~wsserver.errors.ProtocolError`, with
    its wire code) if it would fail once started (see the module docstring)."""
    try:
        # The grammar of its tool calls (a forced call, or tools the server
        # describes) compiles (cached) too.
        forced = chat.forced_grammar(frame)
        if forced is not None:
            engine.grammars.compile(grammar=forced.grammar, json_schema=None, field="tools")
        if forced is not None or frame.grammar is not None or frame.json_schema is not None:
            _check_grammar_room(engine.grammar_calls_running())
        engine.grammars.compile(grammar=frame.grammar, json_schema=frame.json_schema)
        for key, _ in frame.logit_bias or ():
            if isinstance(key, int) and not 0 <= key < engine.n_vocab:
                raise BackendError(
                    f"logit_bias: token {key} is not in the model's vocabulary "
                    f"(ids 0 to {engine.n_vocab - 1})",
                    code="bad_request",
                )
        chat.check(frame)
    except BackendError as exc:
        raise ProtocolError(exc.code, str(exc), frame.id) from None
    _check_context(frame, engine.n_ctx, prompt)


def _check_context(frame: Generate, n_ctx: int, prompt: Prompt) -> None:
    """A prompt that does not fit the context is refused before the request
    is accepted — before an HTTP response's head, so that the OpenAI API
    can answer it with its status — rather than after it started.
    Tokenizing reads only the model's vocabulary (safe beside the engine
    thread) and costs a few milliseconds for the longest prompt a frame
    may carry (``limits.max_prompt_chars``)."""
    request = GenerationRequest.from_frame(frame, default_max_tokens=1)
    try:
        tokens = prompt(request)[0]
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


def _check_grammar_room(running: int) -> None:
    if running >= MAX_ABANDONED_GRAMMAR_CALLS:
        raise BackendError(
            f"a grammar, JSON schema or tool call grammar cannot start now: {running} grammar "
            "computation(s) given up on past backend.llama.grammar_deadline_ms still run "
            f"(at most {MAX_ABANDONED_GRAMMAR_CALLS}); try again when they end",
            code="overloaded",
        )

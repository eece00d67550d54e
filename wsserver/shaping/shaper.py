"""One request's output, shaped: the engine's text → text, reasoning and call parts (sans-I/O).

Theory of operation
-------------------
An engine produces text (and, if it parses its model's calls itself, call
parts: the openai backend's upstream does). What the client gets is three
kinds of parts — the answer's text, the model's reasoning, its tool calls —
and how the request ended. :class:`Shaper` makes the one from the other,
for one request, built from the request (its ``reasoning_format``, its
tools, ``tool_choice``, ``parallel_tool_calls``) and the engine's
description of its output for that request, :class:`OutputFormat` —
:meth:`wsserver.backends.base.Backend.output_format`, the engine's one call
about it: whether the prompt opened a think block, and the syntax in which
calls come (:mod:`wsserver.shaping.tool_calls`).

Each piece of text goes, in order, through

1. the :class:`~wsserver.shaping.reasoning.ReasoningSplitter` (``reasoning_format``
   ``auto`` on a chat request): the think block is reasoning, the rest the
   answer; once the block is over the splitter is dropped, and the answer
   goes on as it comes;
2. the syntax's call parser (a request with tools, unless ``tool_choice``
   is ``none``): the answer's content, and its call parts;

and the parts go into a :class:`Parts` — the pipeline's
:class:`~wsserver.core.pacing.Coalescer`, which paces them into frames. The
tokens a piece came with are counted with its reasoning or its answer, its
log-probabilities with the answer. A call part the engine hands over
itself (:meth:`Shaper.call`) ends a think block still undecided and goes
through the ``relay`` syntax's parser, after whatever text came before it.

At the end (:meth:`Shaper.end`) what was held back is released or judged,
and the engine's outcome becomes the request's: ``tool_calls`` when the
model stopped after calling, ``error`` / ``invalid_tool_call`` for a call
that was refused, and — for an output cut by ``max_tokens`` (``length``) —
the call it cut short released as far as it got.

It does nothing per piece that a piece does not need: a request without a
think block to find or tools to parse hands each piece straight on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import orjson

from ..core.events import Outcome
from ..core.logprobs import TokenLogprob
from ..core.protocol import Generate
from .reasoning import ReasoningSplitter, Split
from .tool_calls import CallParser, CallPart, Syntax, ToolSplit, parser_for

__all__ = ["OutputFormat", "Parts", "Shaper"]

_NOTHING: Final = ToolSplit()


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What an engine's output looks like for one request."""

    #: The prompt ends inside an open think block (a chat template that
    #: opens it): the output starts as reasoning, before any ``<think>``.
    opens_reasoning: bool = False
    #: The syntax of the model's tool calls (:mod:`wsserver.shaping.tool_calls`):
    #: written in the text, or ``relay`` — handed over as parts
    #: (:meth:`~wsserver.backends.base.Sink.offer_call`), the text being
    #: content as it is. An engine that does not know: ``any``.
    tool_syntax: Syntax = "any"


class Parts(Protocol):
    """Where a shaper puts its parts (the :class:`~wsserver.core.pacing.Coalescer`)."""

    def add(self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """Answer text, the tokens it came with and their log-probabilities."""

    def add_reasoning(self, text: str, tokens: int) -> None:
        """Reasoning text and its tokens."""

    def add_calls(self, parts: tuple[CallPart, ...]) -> None:
        """Tool call parts (their tokens came with the text)."""


class Shaper:
    """Turns one request's output into parts (see the module docstring)."""

    __slots__ = ("_calls", "_error", "_reasoning")

    def __init__(
        self,
        request: Generate,
        output: OutputFormat,
        *,
        reasoning_format: str = "auto",
        new_id: Callable[[], str] | None = None,
    ) -> None:
        """``reasoning_format``: the server's, for a request that gives none;
        ``new_id``: a fresh call id (tests; default: the syntax's shape)."""
        chosen = request.reasoning_format or reasoning_format
        #: Splits the think block from the answer until the block is over.
        self._reasoning = (
            ReasoningSplitter(opened=output.opens_reasoning)
            if chosen == "auto" and request.messages is not None
            else None
        )
        #: Finds the model's tool calls in the answer (a request with tools).
        self._calls = _parser(request, output.tool_syntax, new_id)
        #: Why the model's tool call was refused (the request then ends in error).
        self._error: str | None = None

    def text(
        self, out: Parts, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        """A piece of the engine's text, made of ``tokens`` tokens."""
        reasoning = self._reasoning
        if reasoning is None:
            self._answer(out, text, tokens, logprobs)
            return
        split = reasoning.feed(text, tokens)
        if reasoning.answering:
            self._reasoning = None  # from now on every piece is answer, as it comes
        self._split(out, split, tokens, logprobs)

    def call(self, out: Parts, part: CallPart, tokens: int) -> None:
        """A part of a call the engine parsed itself, made of ``tokens`` tokens."""
        reasoning, self._reasoning = self._reasoning, None
        if reasoning is not None:
            self._split(out, reasoning.settle(), 0)
        found = self._calls.part(part) if self._calls is not None else _NOTHING
        self._put(out, found, tokens)

    def end(self, out: Parts, outcome: Outcome) -> Outcome:
        """The engine's end: release or judge what was held back, and how
        the request ended, as its tool calls make it."""
        reasoning, self._reasoning = self._reasoning, None
        if reasoning is not None:
            self._split(out, reasoning.flush(), 0)
        calls = self._calls
        if calls is None:
            return outcome
        # Cut off by max_tokens: a call cut short is released as far as it got.
        self._put(out, calls.flush(cut=outcome.reason == "length"), 0)
        if outcome.reason not in ("stop", "length"):
            return outcome
        if self._error is not None:
            return dataclasses.replace(
                outcome,
                reason="error",
                error_code="invalid_tool_call",
                error_message=self._error,
                stop_sequence=None,
            )
        if outcome.reason == "stop" and calls.calls_made:
            return dataclasses.replace(outcome, reason="tool_calls", stop_sequence=None)
        return outcome

    def _split(
        self, out: Parts, split: Split, tokens: int, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        """Reasoning, then the answer."""
        out.add_reasoning(split.reasoning, split.reasoning_tokens)
        self._answer(out, split.answer, max(0, tokens - split.reasoning_tokens), logprobs)

    def _answer(
        self, out: Parts, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> None:
        """Answer text — through the call parser, if any."""
        calls = self._calls
        if calls is None:
            out.add(text, tokens, logprobs)
            return
        self._put(out, calls.feed(text) if text else _NOTHING, tokens, logprobs)

    def _put(
        self, out: Parts, found: ToolSplit, tokens: int, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        """Content (and the tokens it came with), then the call parts."""
        out.add(found.content, tokens, logprobs)
        if found.calls:
            out.add_calls(found.calls)
        if found.error is not None and self._error is None:
            self._error = found.error


def _parser(
    request: Generate, syntax: Syntax, new_id: Callable[[], str] | None
) -> CallParser | None:
    """The parser of ``request``'s tool calls, if it has tools."""
    if request.tools is None or request.tool_choice == "none":
        return None
    names = frozenset(tool["function"]["name"] for tool in orjson.loads(request.tools))
    parallel = request.parallel_tool_calls is not False
    return parser_for(syntax, names=names, parallel=parallel, new_id=new_id)

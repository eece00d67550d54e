"""The per-request and per-sequence state of the batched engine (see :mod:`.llama_engine`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.logprobs import TokenLogprob
from ..core.textstream import TextAssembler
from ..shaping.reasoning import ReasoningBudget
from .base import CancelEvent, GenerationRequest, Outcome, Sink, Submission

__all__ = ["Job", "RequestStats", "SequenceState", "common_prefix"]


@dataclass
class RequestStats:
    """What one request cost the engine (read by tests and the benchmark)."""

    prompt_tokens: int = 0
    #: Prompt tokens whose cells came from the prompt cache.
    reused: int = 0
    #: Prompt tokens decoded for it (re-runs after an abort included).
    decoded: int = 0
    sequence: int = -1
    aborted: bool = False
    #: Tokens written instead of sampled to close a think block (its budget spent).
    forced: int = 0


@dataclass(eq=False)
class SequenceState:
    index: int
    #: The tokens whose KV cells this sequence holds, position by position.
    tokens: list[int] = field(default_factory=list)
    job: Job | None = None


@dataclass(eq=False)
class Job:
    request: GenerationRequest
    sink: Sink
    cancel: CancelEvent
    submission: Submission
    stats: RequestStats
    prompt: list[int] = field(default_factory=list)
    max_tokens: int = 0
    seq: SequenceState | None = None
    #: Prompt tokens whose cells are committed (the reused prefix included).
    fed: int = 0
    #: Sampled, its text delivered or held, not yet decoded.
    next_token: int | None = None
    sampler: Any = None
    #: The request's grammar sampler (None: unconstrained), and how many
    #: UTF-8 continuation bytes its output still owes.
    grammar: Any = None
    #: A constrained request's chain is in two parts around the grammar:
    #: ``pre`` (bias, penalties, DRY; None if none) then ``sampler``, which
    #: keeps at most ``keeps`` of the most likely tokens (0: any number).
    pre: Any = None
    keeps: int = 0
    #: Plain greedy (temperature 0, nothing that moves logits, no XTC): the
    #: token is the logits' argmax, read without building a candidate list.
    argmax: bool = False
    utf8_needed: int = 0
    assembler: TextAssembler | None = None
    produced: int = 0
    #: Text the channel has not taken yet (a token's, then perhaps the tail),
    #: with its tokens' count and log-probabilities (if asked for).
    outbox: deque[tuple[str, int, tuple[TokenLogprob, ...]]] = field(default_factory=deque)
    ending: Outcome | None = None
    #: Paused on a full channel; ``when_room`` clears it.
    waiting_room: bool = False
    cancelled: bool = False
    #: Has prompt tokens in the decode in flight (a cancel then aborts it).
    in_flight: bool = False
    started: bool = False
    on_cancel: Callable[[], None] | None = None
    #: The request's reasoning budget (None: none asked, nothing counted), and
    #: the close tag's tokens still to write instead of sampling once it is spent.
    budget: ReasoningBudget | None = None
    forced: deque[int] = field(default_factory=deque)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

"""A model's reasoning, split from its answer (sans-I/O).

Reasoning models write their thoughts first, in a think block —
``<think>…</think>`` — then the answer. Some chat templates open the block
themselves at the end of the generation prompt (Qwen 3, DeepSeek R1), so the
output starts inside it and only the close appears. With ``reasoning_format``
``auto`` (llama-server's meaning) the block is taken out of the answer and
sent as reasoning; with ``none`` the text is left as it is.

:class:`ReasoningSplitter` works on final text (after
:class:`~wsserver.core.textstream.TextAssembler`, which already holds back half a
character), piece by piece as tokens arrive, and holds back exactly what may
still become a marker — ``"<thi"`` at the start, ``"</th"`` inside the block —
so a marker split across tokens, or across the bytes of one, is still found,
and nothing it released is ever taken back. The block opens only at the start
of the output (after whitespace); after it closes, everything is answer, and
the whitespace between the close and the answer is dropped, as llama-server
drops it.

:class:`ReasoningBudget` counts a sequence's tokens inside its think block
for an engine that bounds it (``reasoning_budget_tokens``; Anthropic's
``thinking.budget_tokens``): once the block holds ``budget`` tokens and is
still open, the engine writes :data:`FORCED_CLOSE` as the next tokens instead
of sampling, and the model goes on with its answer (llama-server's reasoning
budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "CLOSE",
    "FORCED_CLOSE",
    "OPEN",
    "REASONING_FORMATS",
    "ReasoningBudget",
    "ReasoningSplitter",
    "Split",
    "opens_reasoning",
]

OPEN: Final = "<think>"
CLOSE: Final = "</think>"
REASONING_FORMATS: Final = ("none", "auto")
#: What an engine writes to end a think block whose budget is spent: the close
#: tag and the blank line that templates put before the answer (Qwen 3's own
#: empty block is ``<think>\n\n</think>\n\n``).
FORCED_CLOSE: Final = CLOSE + "\n\n"

_State = Literal["start", "reasoning", "answer"]


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open think block."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


@dataclass(frozen=True, slots=True)
class Split:
    """What one piece of text became: reasoning, then answer (either may be "")."""

    reasoning: str = ""
    answer: str = ""
    #: How many of the piece's tokens (and earlier undecided ones) were reasoning.
    reasoning_tokens: int = 0


class ReasoningSplitter:
    """Splits a stream of text into reasoning and answer."""

    __slots__ = ("_held", "_state", "_trim", "_undecided")

    def __init__(self, *, opened: bool = False) -> None:
        self._state: _State = "reasoning" if opened else "start"
        self._held = ""
        self._undecided = 0
        #: Drop whitespace before the answer (just after the block closed).
        self._trim = False

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    @property
    def answering(self) -> bool:
        """Whether the block is over for good: everything from now on is
        answer, as it comes (the whitespace after the block was dropped)."""
        return self._state == "answer" and not self._trim

    def feed(self, text: str, tokens: int = 0) -> Split:
        """Add a piece of final text made of ``tokens`` tokens."""
        if self._state == "answer":
            return Split(answer=self._answer(text))
        text = self._held + text
        self._held = ""
        if self._state == "start":
            stripped = text.lstrip()
            if len(stripped) < len(OPEN) and OPEN.startswith(stripped):
                self._held = text  # whitespace, or what may become "<think>"
                self._undecided += tokens
                return Split()
            if not stripped.startswith(OPEN):
                self._state = "answer"
                self._undecided = 0
                return Split(answer=text)
            self._state = "reasoning"
            text = stripped[len(OPEN) :]
            tokens += self._undecided
            self._undecided = 0
        return self._reasoning(text, tokens)

    def _reasoning(self, text: str, tokens: int) -> Split:
        end = text.find(CLOSE)
        if end >= 0:
            self._state = "answer"
            self._trim = True
            return Split(text[:end], self._answer(text[end + len(CLOSE) :]), tokens)
        keep = 0
        for length in range(min(len(CLOSE) - 1, len(text)), 0, -1):
            if CLOSE.startswith(text[-length:]):
                keep = length
                break
        self._held = text[len(text) - keep :]
        return Split(reasoning=text[: len(text) - keep], reasoning_tokens=tokens)

    def _answer(self, text: str) -> str:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        return text

    def settle(self) -> Split:
        """Something that is not text came (a call the engine parsed itself):
        a block can no longer open, or it is over; what was held back goes
        out as what it was, and everything from now on is answer."""
        held, self._held = self._held, ""
        state, self._state = self._state, "answer"
        self._trim = False
        self._undecided = 0
        return Split(reasoning=held) if state == "reasoning" else Split(answer=held)

    def flush(self) -> Split:
        """The end of the output: release what was held back."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return Split(reasoning=held)
        if self._state == "start":
            self._state = "answer"
            return Split(answer=held)
        return Split()


class ReasoningBudget:
    """Counts one sequence's tokens inside its think block against a budget.

    The engine calls :meth:`feed` once per token it produced, with the final
    text that token released (``""`` while text is held back), and asks
    :meth:`exhausted` before it samples the next one. The token that opens the
    block is not counted, nor the one that closes it; everything between is
    (the first tokens of a close tag split across several too, as they look
    like thought until it completes), so the block's text is at most
    ``budget`` tokens. It never takes back what
    it counted, and once the block closed it is done (answer text costs one
    comparison a token). Only a request that asked for a budget has one.
    """

    __slots__ = ("_splitter", "budget", "spent")

    def __init__(self, budget: int, *, opened: bool = False) -> None:
        self.budget = budget
        self.spent = 0
        self._splitter = ReasoningSplitter(opened=opened)

    def feed(self, text: str) -> None:
        """One token was produced, releasing ``text``."""
        was_open = self._splitter.in_reasoning
        if text:
            self._splitter.feed(text)
        if was_open and self._splitter.in_reasoning:
            self.spent += 1

    def exhausted(self) -> bool:
        """The block is open and holds ``budget`` tokens: close it now."""
        return self.spent >= self.budget and self._splitter.in_reasoning

"""A model's reasoning, split from its answer (sans-I/O).

Reasoning models write their thoughts first, in a think block —
``<think>…</think>`` — then the answer. Some chat templates open the block
themselves at the end of the generation prompt (Qwen 3, DeepSeek R1), so the
output starts inside it and only the close appears. With ``reasoning_format``
``auto`` (llama-server's meaning) the block is taken out of the answer and
sent as reasoning; with ``none`` the text is left as it is.

:class:`ReasoningSplitter` works on final text (after
:class:`~wsserver.textstream.TextAssembler`, which already holds back half a
character), piece by piece as tokens arrive, and holds back exactly what may
still become a marker — ``"<thi"`` at the start, ``"</th"`` inside the block —
so a marker split across tokens, or across the bytes of one, is still found,
and nothing it released is ever taken back. The block opens only at the start
of the output (after whitespace); after it closes, everything is answer, and
the whitespace between the close and the answer is dropped, as llama-server
drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["CLOSE", "OPEN", "REASONING_FORMATS", "ReasoningSplitter", "Split", "opens_reasoning"]

OPEN: Final = "<think>"
CLOSE: Final = "</think>"
REASONING_FORMATS: Final = ("none", "auto")

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

    def flush(self) -> Split:
        """The end of the output: release what was held back."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return Split(reasoning=held)
        if self._state == "start":
            self._state = "answer"
            return Split(answer=held)
        return Split()

"""A deterministic stand-in for a model, for tests and benchmarks.

The text depends only on (prompt or messages, seed): the same request always
gives the same text, and a larger ``max_tokens`` extends it. Words come from a
small vocabulary that includes multi-byte UTF-8 (accents, CJK, emoji); those
words are emitted as *byte-level tokens* of one to three bytes each, so
characters arrive split across tokens exactly as a byte-fallback tokenizer
delivers them, and the real :class:`~wsserver.textstream.TextAssembler` has to
put them back together.

Instead of the random words, the backend can stream a given text: the prompt
itself (``echo``, the last user message of a chat) or a fixed text
(``text``, e.g. read from ``backend.fake.text_file``), cut into word-sized
tokens the way a BPE tokenizer roughly cuts English. The request then ends
with reason ``stop`` when the text runs out, or ``length`` at ``max_tokens``
before that. Tests and benchmarks use this to stream known markdown at any rate.

**Log-probabilities.** The fake is a deterministic model: the token it
emits had probability 1 (log-probability 0) and every other none, so asked
for ``top_logprobs`` it lists the emitted token first, at 0, then other
words of its vocabulary at :data:`~wsserver.logprobs.LOGPROB_FLOOR`
(OpenAI's "never"). The shapes, counts and pacing are real; the numbers
are the honest ones for a model that cannot choose.

Timing is simulated with waits on the request's cancel event, so a cancel
interrupts both the simulated prefill and the pause between tokens at once.
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
import time
from collections.abc import Iterable

import orjson

from ..errors import GenerationCancelled
from ..logprobs import LOGPROB_FLOOR, TokenLogprob, TopLogprob, token_text
from ..protocol import DoneReason
from ..textstream import TextAssembler
from .base import GenerationRequest, Outcome, ThreadedBackend, TokenSink

__all__ = ["FakeBackend", "fake_tokens", "text_tokens"]

# A word with its leading space, a run of digits, punctuation, or whitespace:
# roughly the pre-tokenizer of GPT-2-style BPE, so markdown syntax arrives in
# pieces (``*``, ``**``, fence backticks) like it does from a real model.
_TOKEN_RE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+|_+", re.UNICODE)
_MAX_TOKEN_CHARS = 8

_WORDS = (
    "the",
    "stream",
    "of",
    "tokens",
    "flows",
    "to",
    "every",
    "client",
    "without",
    "pause",
    "and",
    "a",
    "model",
    "speaks",
    "while",
    "sockets",
    "wait",
    "café",
    "naïve",
    "über",
    "日本語",
    "テキスト",
    "中文",
    "한국어",
    "😀",
    "🚀",
    "👩‍💻",
    "Ωmega",
    "façade",
    "∑",
)


def _rng(request: GenerationRequest) -> random.Random:
    source = (
        request.prompt
        if request.prompt is not None
        else orjson.dumps([[m.role, m.content] for m in request.messages or ()]).decode()
    )
    digest = hashlib.sha256(f"{request.seed}\x00{source}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def fake_tokens(request: GenerationRequest) -> FakeTokenStream:
    """The (infinite) token stream of a request, as raw bytes per token."""
    return FakeTokenStream(_rng(request))


def text_tokens(text: str) -> list[bytes]:
    """``text`` cut into word-sized tokens (UTF-8 bytes); they join back to it."""
    tokens = []
    position = 0
    for match in _TOKEN_RE.finditer(text):
        if match.start() > position:  # anything the pattern missed, kept as is
            tokens.append(text[position : match.start()].encode())
        piece = match.group()
        for start in range(0, len(piece), _MAX_TOKEN_CHARS):
            tokens.append(piece[start : start + _MAX_TOKEN_CHARS].encode())
        position = match.end()
    if position < len(text):
        tokens.append(text[position:].encode())
    return tokens


def _echoed(request: GenerationRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    users = [m.content for m in request.messages or () if m.role == "user"]
    return users[-1] if users else ""


class FakeTokenStream:
    """Yields the byte tokens of an endless deterministic text."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._pending: list[bytes] = []
        self._first = True

    def __iter__(self) -> FakeTokenStream:
        return self

    def __next__(self) -> bytes:
        while not self._pending:
            self._pending = self._next_word()
        return self._pending.pop(0)

    def _next_word(self) -> list[bytes]:
        word = self._rng.choice(_WORDS)
        text = word if self._first else " " + word
        self._first = False
        data = text.encode()
        if data.isascii():
            return [data]
        # Split non-ASCII words into 1-3 byte pieces, cutting inside characters.
        pieces = []
        while data:
            size = self._rng.randint(1, 3)
            pieces.append(data[:size])
            data = data[size:]
        return pieces


def fake_logprob(token: bytes, top: int) -> TokenLogprob:
    """The fake's entry for a token it emitted (see the module docstring)."""
    alternatives = [TopLogprob(token_text(token), 0.0, token)]
    for word in _WORDS:
        if len(alternatives) > top - 1:
            break
        raw = (" " + word).encode()
        if raw != token:
            alternatives.append(TopLogprob(token_text(raw), LOGPROB_FLOOR, raw))
    return TokenLogprob(token_text(token), 0.0, token, tuple(alternatives[:top]))


class FakeBackend(ThreadedBackend):
    """Deterministic fake model with a configurable speed."""

    honours = frozenset({"logprobs"})

    def __init__(
        self,
        *,
        tokens_per_s: float = 50.0,
        prefill_ms_per_token: float = 0.0,
        parallel: int = 0,
        max_waiting: int = 64,
        model_name: str = "fake",
        text: str | None = None,
        echo: bool = False,
    ) -> None:
        self.tokens_per_s = tokens_per_s
        self.prefill_ms_per_token = prefill_ms_per_token
        self.slots = parallel
        self.max_waiting = max_waiting
        self.model_name = model_name
        #: Stream this text instead of random words (``echo`` wins over it).
        self.text = text
        self.echo = echo
        self._text_tokens = text_tokens(text) if text is not None else None

    def prompt_tokens(self, request: GenerationRequest) -> int:
        """The simulated prompt's token count (what ``usage.prompt_tokens`` reports)."""
        if request.prompt is not None:
            size = len(request.prompt.encode())
        else:
            size = sum(len(m.content.encode()) + 4 for m in request.messages or ())
        # Roughly what a BPE tokenizer gives for English: four bytes a token.
        return max(1, size // 4)

    def generate(
        self,
        request: GenerationRequest,
        *,
        slot: int,
        sink: TokenSink,
        cancel: threading.Event,
    ) -> Outcome:
        prompt_tokens = self.prompt_tokens(request)
        prefill_s = prompt_tokens * self.prefill_ms_per_token / 1000.0
        if prefill_s > 0 and cancel.wait(prefill_s):
            raise GenerationCancelled(request.id)
        sink.prompt_processed(prompt_tokens)
        assembler = TextAssembler(request.stop)
        interval = 1.0 / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
        start = time.monotonic()
        produced = 0
        if self.echo:
            tokens: Iterable[bytes] = text_tokens(_echoed(request))
        elif self._text_tokens is not None:
            tokens = self._text_tokens
        else:
            tokens = fake_tokens(request)
        ended: DoneReason = "stop" if self.echo or self._text_tokens is not None else "length"
        for token in tokens:
            if produced >= request.max_tokens:
                break
            if interval:
                # Pace against the start time so rounding does not drift.
                delay = start + produced * interval - time.monotonic()
                if delay > 0 and cancel.wait(delay):
                    raise GenerationCancelled(request.id)
            elif cancel.is_set():
                raise GenerationCancelled(request.id)
            produced += 1
            text = assembler.feed(token)
            if request.logprobs is not None:
                sink.emit(text, 1, (fake_logprob(token, request.logprobs),))
            else:
                sink.emit(text, 1)
            if assembler.stopped:
                return Outcome("stop", prompt_tokens, produced)
        tail = assembler.flush()
        if tail:
            sink.emit(tail, 0)
        if produced >= request.max_tokens:
            ended = "length"
        return Outcome(ended, prompt_tokens, produced)

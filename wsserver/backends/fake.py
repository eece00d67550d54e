"""A deterministic stand-in for a model, for tests and benchmarks.

The text depends only on (prompt or messages, seed): the same request always
gives the same text, and a larger ``max_tokens`` extends it. Words come from a
small vocabulary that includes multi-byte UTF-8 (accents, CJK, emoji); those
words are emitted as *byte-level tokens* of one to three bytes each, so
characters arrive split across tokens exactly as a byte-fallback tokenizer
delivers them, and the real :class:`~wsserver.core.textstream.TextAssembler` has to
put them back together.

Instead of the random words, the backend can stream a given text: the prompt
itself (``echo``, the last user message of a chat) or a fixed text
(``text``, e.g. read from ``backend.fake.text_file``), cut into word-sized
tokens the way a BPE tokenizer roughly cuts English. The request then ends
with reason ``stop`` when the text runs out, or ``length`` at ``max_tokens``
before that. Tests and benchmarks use this to stream known markdown at any rate.

**Sampling options it honours** (``honours``; the rest are refused with
``unsupported_option``): ``logit_bias`` over its vocabulary — token id *i*
is the *i*-th word of ``_WORDS`` (:func:`fake_vocabulary`), a text key the
word equal to it; each word is drawn with weight ``exp(bias)`` (so +100
forces a word, -100 or ``false`` bans it), from the same seeded generator —
and ``json_schema`` (``response_format`` on the OpenAI API): a seeded JSON
document that validates against the schema (:mod:`.fake_json`; a schema
keyword it cannot honour is refused). Neither applies to ``echo`` or a fixed
``text``, which are not sampled: a bias is refused there, a schema replaces
them.

**Log-probabilities.** The fake is a deterministic model: the token it
emits had probability 1 (log-probability 0) and every other none, so asked
for ``top_logprobs`` it lists the emitted token first, at 0, then other
words of its vocabulary at :data:`~wsserver.core.logprobs.LOGPROB_FLOOR`
(OpenAI's "never"). The shapes, counts and pacing are real; the numbers
are the honest ones for a model that cannot choose.

**Reasoning budget** (``reasoning_budget_tokens``): counted as the llama
engine counts it; once spent inside an open think block, the fake writes the
close tag's tokens (:data:`~wsserver.shaping.reasoning.FORCED_CLOSE`) and goes on
with its text after its own close tag — the answer a model gives once its
thinking is cut short.

Timing is simulated with waits on the request's cancel event, so a cancel
interrupts both the simulated prefill and the pause between tokens at once.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import threading
import time
from collections.abc import Iterable, Iterator

import orjson

from ..core.logprobs import LOGPROB_FLOOR, TokenLogprob, TopLogprob, token_text
from ..core.protocol import DoneReason, Generate
from ..core.sampling import LogitBias
from ..core.textstream import TextAssembler
from ..errors import BackendError, GenerationCancelled, ProtocolError
from ..shaping.reasoning import CLOSE, FORCED_CLOSE, ReasoningBudget
from .base import GenerationRequest, Outcome, TokenSink
from .fake_embed import FakeEmbedDoor
from .fake_json import Unsupported, fake_document
from .threaded import ThreadedBackend

__all__ = [
    "FakeBackend",
    "fake_logprob",
    "fake_tokens",
    "fake_vocabulary",
    "json_document",
    "text_tokens",
    "word_weights",
]

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
    return FakeTokenStream(_rng(request), word_weights(request.sampling.logit_bias))


def fake_vocabulary() -> tuple[str, ...]:
    """The fake's words: ``logit_bias`` token id *i* is the *i*-th."""
    return _WORDS


def word_weights(bias: LogitBias) -> list[float] | None:
    """Each word's weight under ``bias`` (``None``: no bias, a uniform draw).

    Raises :class:`~wsserver.errors.BackendError` (``bad_request``) for a key
    outside the vocabulary, or a bias that bans every word.
    """
    if not bias:
        return None
    logits = [0.0] * len(_WORDS)
    for key, value in bias:
        if isinstance(key, int):
            if not 0 <= key < len(_WORDS):
                raise BackendError(
                    f"logit_bias: token {key} is not in the fake engine's vocabulary "
                    f"(ids 0 to {len(_WORDS) - 1})",
                    code="bad_request",
                )
            logits[key] += value
        else:
            word = key.strip()
            if word not in _WORDS:
                raise BackendError(
                    f"logit_bias: {key[:40]!r} is not a word of the fake engine's vocabulary",
                    code="bad_request",
                )
            logits[_WORDS.index(word)] += value
    peak = max(logits)
    if peak == -math.inf:
        raise BackendError("logit_bias bans every word of the fake engine", code="bad_request")
    return [0.0 if v == -math.inf else math.exp(v - peak) for v in logits]


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

    def __init__(self, rng: random.Random, weights: list[float] | None = None) -> None:
        self._rng = rng
        self._weights = weights
        self._pending: list[bytes] = []
        self._first = True

    def __iter__(self) -> FakeTokenStream:
        return self

    def __next__(self) -> bytes:
        while not self._pending:
            self._pending = self._next_word()
        return self._pending.pop(0)

    def _next_word(self) -> list[bytes]:
        if self._weights is None:
            word = self._rng.choice(_WORDS)
        else:
            word = self._rng.choices(_WORDS, self._weights)[0]
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


def within_budget(tokens: Iterable[bytes], budget: ReasoningBudget) -> Iterator[bytes]:
    """``tokens`` under a reasoning budget (the caller feeds it each token's
    text before asking for the next): once it is spent, the close tag's
    tokens, then the text after the script's own close tag."""
    source = iter(tokens)
    for token in source:
        if budget.exhausted():
            yield from text_tokens(FORCED_CLOSE)
            # Skip the rest of the script's think block (the model moved on).
            seen, close = token, CLOSE.encode()
            while close not in seen:
                following = next(source, None)
                if following is None:
                    return
                seen += following
            rest = seen[seen.index(close) + len(close) :].lstrip()
            if rest:
                yield rest
            yield from source
            return
        yield token


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


def json_document(schema: str, rng: random.Random) -> str:
    """The JSON-shaped mode's text for ``schema`` (JSON text). Raises
    :class:`~wsserver.errors.BackendError` (``unsupported_option``) for a
    schema the fake cannot honour."""
    words = [w for w in _WORDS if w.isascii()]
    try:
        document = fake_document(orjson.loads(schema), rng, words)
    except Unsupported as exc:
        raise BackendError(
            f"'json_schema' is not supported by the fake engine as given: {exc}",
            code="unsupported_option",
        ) from None
    return orjson.dumps(document).decode()


class FakeBackend(ThreadedBackend):
    """Deterministic fake model with a configurable speed."""

    honours = frozenset(
        {"logprobs", "logit_bias", "json_schema", "tools", "reasoning_budget_tokens"}
    )

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
        #: Its embeddings (one door: tests may wrap its ``start``).
        self.embed_door = FakeEmbedDoor(self, n_vocab=len(_WORDS))

    def embeddings(self) -> FakeEmbedDoor:
        """The fake embeds and reranks (:mod:`.fake_embed`)."""
        return self.embed_door

    def count_prompt_tokens(self, request: GenerationRequest) -> int | None:
        """The simulated count: what the request's ``usage.prompt_tokens`` will say."""
        return self.prompt_tokens(request)

    def check(self, frame: Generate) -> None:
        """Refuse what the fake cannot honour as asked (see the module docstring)."""
        super().check(frame)
        try:
            if frame.logit_bias:
                if self.echo or self.text is not None:
                    raise ProtocolError(
                        "unsupported_option",
                        "'logit_bias' is not supported by this fake engine: it streams "
                        "a fixed text (echo or text), which is not sampled",
                        frame.id,
                    )
                word_weights(frame.logit_bias)
            if frame.json_schema is not None:
                json_document(frame.json_schema, random.Random(0))
        except BackendError as exc:
            raise ProtocolError(exc.code, str(exc), frame.id) from None

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
        if request.json_schema is not None:
            tokens: Iterable[bytes] = text_tokens(json_document(request.json_schema, _rng(request)))
        elif self.echo:
            tokens = text_tokens(_echoed(request))
        elif self._text_tokens is not None:
            tokens = self._text_tokens
        else:
            tokens = fake_tokens(request)
        fixed = self.echo or self._text_tokens is not None or request.json_schema is not None
        budget = None
        if request.reasoning_budget is not None:
            budget = ReasoningBudget(request.reasoning_budget)
            tokens = within_budget(tokens, budget)
        ended: DoneReason = "stop" if fixed else "length"
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
            if budget is not None:
                budget.feed(text)
            if request.logprobs is not None:
                sink.emit(text, 1, (fake_logprob(token, request.logprobs),))
            else:
                sink.emit(text, 1)
            if assembler.stopped:
                return Outcome("stop", prompt_tokens, produced, stop_sequence=assembler.stop_string)
        tail = assembler.flush()
        if tail:
            sink.emit(tail, 0)
        if produced >= request.max_tokens:
            ended = "length"
        return Outcome(ended, prompt_tokens, produced)

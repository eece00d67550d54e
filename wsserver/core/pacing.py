"""Frame pacing: when to turn pending tokens into one ``delta`` frame (sans-I/O).

Two settings, ``flush_window`` (``stream.flush_ms``) and ``flush_tokens``:

* **The first text goes at once** — time to first token never waits.
* **The ceiling.** After that, two deltas are never closer than
  ``flush_window``: at most one delta per window, so at most
  ``1 / flush_window`` frames a second *whatever the token rate*. Tokens that
  arrive faster merge into the next frame; nothing is dropped or reordered.
* **The wait.** Pending text waits at most ``flush_window`` from the moment the
  sender first saw it (:meth:`Coalescer.due` is the sender's look at it).
* **The count.** Once ``flush_tokens`` tokens are pending, the text does not
  wait out its window: it goes as soon as the ceiling allows, that is
  ``flush_window`` after the previous delta. So ``flush_tokens = 1`` sends any
  text as early as the ceiling allows (lowest latency), and a larger value lets
  a slow trickle of tokens gather into fewer frames.

Neither rule can break the ceiling: the text pending after a flush was seen
after it, so its own window ends no sooner than the previous delta's.

* **The size.** One frame carries at most ``max_chars`` characters
  (:data:`FRAME_TEXT_CHARS`, 64 KiB of UTF-8 at most): once that much is
  pending (:attr:`Coalescer.full`) it goes as soon as the ceiling allows, as
  for the count, and the sender takes nothing more from the channel until
  it has gone, so the rest waits in the bounded channel
  and the engine pauses. At default settings it never binds (a window holds a
  few tokens); it bounds what an unlimited token rate with a long window would
  otherwise gather into one frame.

* **Log-probabilities** (a request that asked for them): each token's entry
  rides with it and a frame carries the entries of the tokens it merged, at
  most ``max_logprob_tokens`` (:data:`FRAME_LOGPROB_TOKENS`) of them; past
  that the frame is full, as for the size. A token whose text is held back
  (half a character, a possible stop string) has its entry in the frame
  whose window it arrived in, its text in a later one; entries whose text
  never comes (a stop string's tokens) may go in a frame of their own with
  no text.

* **Tool calls** (:mod:`wsserver.shaping.tool_calls`): a call's parts ride after
  the text and count toward ``max_chars`` like it; a frame takes parts up to
  that size (at least one), and the rest wait for the next window.

At a flush *everything* pending goes into one frame. While the socket is slow
the sender is parked in ``send()``; tokens pile up in the channel meanwhile and
come out merged at the next flush: fewer, larger frames. Only the last delta
of a request, sent just before its ``done``, may come sooner: the sender
flushes what is left at the end instead of holding the ``done`` back.
"""

from __future__ import annotations

from .call_parts import CallPart
from .logprobs import TokenLogprob

__all__ = ["FRAME_TEXT_CHARS", "Coalescer"]

#: The most text one ``delta`` frame carries (characters; ≤ 4 bytes each in UTF-8).
FRAME_TEXT_CHARS = 16 * 1024
#: The most tokens' log-probabilities one ``delta`` frame carries.
FRAME_LOGPROB_TOKENS = 16


class Coalescer:
    """Accumulates text pieces and says when they should be flushed."""

    __slots__ = (
        "_calls",
        "_calls_taken",
        "_chars",
        "_flushed_once",
        "_last_flush",
        "_logprobs",
        "_parts",
        "_reasoning",
        "_reasoning_taken",
        "_reasoning_tokens",
        "_seen_at",
        "_tokens",
        "flush_tokens",
        "flush_window",
        "max_chars",
        "max_logprob_tokens",
    )

    def __init__(
        self,
        *,
        flush_window: float,
        flush_tokens: int,
        max_chars: int = FRAME_TEXT_CHARS,
        max_logprob_tokens: int = FRAME_LOGPROB_TOKENS,
    ) -> None:
        if flush_window < 0 or flush_tokens < 1 or max_chars < 1:
            raise ValueError("flush_window must be >= 0, flush_tokens and max_chars >= 1")
        self.flush_window = flush_window
        self.flush_tokens = flush_tokens
        self.max_chars = max_chars
        self.max_logprob_tokens = max(1, max_logprob_tokens)
        self._logprobs: list[TokenLogprob] = []
        self._chars = 0
        self._parts: list[str] = []
        self._tokens = 0
        # Reasoning (wsserver.shaping.reasoning) pending beside the text: it goes
        # first in the same frame, and is paced and bounded with it.
        self._reasoning: list[str] = []
        self._reasoning_tokens = 0
        self._reasoning_taken = False
        # Tool call parts, after the text; taken up to a frame's size.
        self._calls: list[CallPart] = []
        self._calls_taken = False
        self._last_flush = 0.0
        self._flushed_once = False
        # When due() first saw the pending text; None until then.
        self._seen_at: float | None = None

    @property
    def pending(self) -> bool:
        """Whether tokens are waiting (text, or tokens whose text is held back)."""
        return (
            self._tokens > 0
            or bool(self._parts)
            or bool(self._reasoning)
            or bool(self._logprobs)
            or bool(self._calls)
        )

    @property
    def has_text(self) -> bool:
        """Whether text is waiting; only then can a flush become due."""
        return bool(self._parts) or bool(self._reasoning) or bool(self._calls)

    @property
    def full(self) -> bool:
        """Whether a frame's worth of text (or of log-probabilities) is
        pending: take no more until it is sent."""
        return self._chars >= self.max_chars or len(self._logprobs) >= self.max_logprob_tokens

    def add(self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if text:
            self._parts.append(text)
            self._chars += len(text)
        self._tokens += tokens
        if logprobs:
            self._logprobs.extend(logprobs)

    def add_reasoning(self, text: str, tokens: int) -> None:
        """Reasoning for the next frame (its tokens count as every token does)."""
        if text:
            self._reasoning.append(text)
            self._chars += len(text)
        self._tokens += tokens
        self._reasoning_tokens += tokens

    def add_calls(self, parts: tuple[CallPart, ...]) -> None:
        """Tool call parts for the next frames (their tokens came with the text)."""
        for part in parts:
            self._calls.append(part)
            self._chars += len(part.arguments)

    def take_calls(self) -> tuple[CallPart, ...]:
        """The call parts for the next frame — at least one, at most a frame's
        size — call just before :meth:`take`; the rest stay pending."""
        size = 0
        count = 0
        for part in self._calls:
            if count and size + len(part.arguments) > self.max_chars:
                break
            size += len(part.arguments)
            count += 1
        taken = tuple(self._calls[:count])
        del self._calls[:count]
        self._calls_taken = bool(taken)
        return taken

    def take_reasoning(self) -> tuple[str, int]:
        """The pending reasoning and its tokens; call just before :meth:`take`."""
        text = "".join(self._reasoning)
        tokens = self._reasoning_tokens
        self._reasoning.clear()
        self._reasoning_tokens = 0
        self._reasoning_taken = bool(text)
        return text, tokens

    def due(self, now: float) -> bool:
        """Whether the pending text should be flushed now.

        The sender calls this after adding what it took from the channel; the
        first call that sees pending text starts that text's window.
        """
        if (
            not self._parts
            and not self._reasoning
            and not self._calls
            and len(self._logprobs) < self.max_logprob_tokens
        ):
            return False
        if not self._flushed_once:
            return True
        if self._seen_at is None:
            self._seen_at = now
        return now >= self.deadline()

    def deadline(self) -> float:
        """When the pending text becomes due if nothing more arrives."""
        ceiling = self._last_flush + self.flush_window
        if self._tokens >= self.flush_tokens or self.full or self._seen_at is None:
            return ceiling
        return max(ceiling, self._seen_at + self.flush_window)

    def take(self, now: float) -> tuple[str, int]:
        """Everything pending, as one text and its token count; starts a new window."""
        text = "".join(self._parts)
        tokens = self._tokens
        self._parts.clear()
        self._tokens = 0
        self._chars = sum(len(part.arguments) for part in self._calls)
        reasoning, self._reasoning_taken = self._reasoning_taken, False
        calls, self._calls_taken = self._calls_taken, False
        if text or reasoning or calls or self._logprobs:
            self._last_flush = now
            self._flushed_once = True
            self._seen_at = None
        return text, tokens

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The pending tokens' log-probabilities (call with :meth:`take`)."""
        entries = tuple(self._logprobs)
        self._logprobs.clear()
        return entries

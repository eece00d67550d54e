"""One request's upstream stream → its sink: the openai backend's relay loop body.

:class:`Relay` turns the bytes of an upstream response into text in the
request's sink: server-sent events (:mod:`wsserver.sse`) → chunks
(:mod:`.openai_wire`) → the text assembler (stop strings, as every engine
has) → :meth:`Sink.offer`. While the sink is full it waits, on the loop, for
:meth:`Sink.when_room` — and since the caller reads the next chunk of the
response only after :meth:`Relay.feed` returns, a full sink stops the reading
of this one response. It outlives a retry (the text so far, nothing yet, and
the assembler carry over; the parser starts afresh with :meth:`Relay.begin`).

Text goes into the sink in pieces of at most :data:`MAX_PIECE_CHARS`: an
upstream's event may be far larger than a token, and the channel's bound in
bytes holds for pieces of that size. What an upstream sends is bounded: an
event at most :data:`MAX_EVENT_BYTES` (larger is ``upstream_bad_stream``);
the completion at most the request's ``max_tokens``, counted from the
upstream's usage when it reports it as it goes, else estimated from the text
(a chunk is at least one token, a token at most :data:`MAX_TOKEN_CHARS`
characters: an estimate that never ends an honest upstream early) — at the
limit the request ends with reason ``length`` and the stream is closed.

What an upstream splits off itself takes every engine's path through the
core's output shaping (:mod:`wsserver.shaping.shaper`: paced, numbered, replayed on
resume): its reasoning (``delta.reasoning_content`` or ``delta.reasoning``)
goes into the text between ``<think>`` and ``</think>``, the reasoning
markers every engine's text has — with ``reasoning_format: "none"`` the
client then sees the block in the answer, as llama-server's ``none`` shows
it — and its ``delta.tool_calls`` go beside the text as call parts
(:meth:`Sink.offer_call`, the ``relay`` syntax: the upstream's ids, names and
argument fragments), each as it arrives once its call's name is known (an
upstream that sends the name late has the parts before it gathered): a
call's fragments reach the client as fragments, paced like text, not
gathered into one, and no text the upstream sends can pass for a call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from ..core.call_parts import FRAGMENT_CHARS, CallPart
from ..core.logprobs import TokenLogprob
from ..core.protocol import DoneReason
from ..core.textstream import TextAssembler
from ..shaping.reasoning import CLOSE, OPEN
from ..sse import DONE, SSEError, SSEParser
from .base import CancelEvent, Outcome, Sink
from .openai_wire import ToolDelta, UpstreamError, parse_chunk

__all__ = ["MAX_EVENT_BYTES", "MAX_PIECE_CHARS", "MAX_TOKEN_CHARS", "Relay", "call_soon"]

#: The largest upstream event (one chunk's JSON) the relay parses.
MAX_EVENT_BYTES = 256 * 1024
#: Text goes into the sink in pieces of at most this many characters.
MAX_PIECE_CHARS = 1024
#: The longest text counted as one token, for the estimate of completion tokens.
MAX_TOKEN_CHARS = 16


class Relay:
    """One request's stream: SSE events → text in the sink, with backpressure."""

    def __init__(
        self,
        sink: Sink,
        cancel: CancelEvent,
        assembler: TextAssembler,
        *,
        max_tokens: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.sink = sink
        self.max_tokens = max_tokens
        #: Completion tokens so far: the upstream's count, or the estimate if larger.
        self.tokens = 0
        #: The stream was cut at ``max_tokens``: close it, do not reuse it.
        self.cut = False
        self._clock = clock
        #: When the last event (not a comment, not a blank line) was parsed.
        self.last_event = 0.0
        self.cancel = cancel
        self.assembler = assembler
        #: Something went into the sink: no retry elsewhere from now on.
        self.offered = False
        self.finish: DoneReason | None = None
        #: ``[DONE]`` was read (or a stop string matched): nothing more to read.
        self.done = False
        self.parser = SSEParser(MAX_EVENT_BYTES)
        self.pieces = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        #: llama-server's figures, from the last chunk that had them.
        self.timings: dict[str, float] | None = None
        #: The request's stop string the upstream said it stopped at.
        self.upstream_stop: str | None = None
        #: The upstream's count of cached prompt tokens, when its usage says.
        self.cached_tokens: int | None = None
        #: Inside the ``<think>`` block written for the upstream's reasoning.
        self.thinking = False
        #: The upstream's tool calls by index: [id, name, arguments not yet written].
        self.calls: dict[int, list[str]] = {}
        #: Indexes of the calls whose first part was written, and the parts not yet counted.
        self.calls_written: set[int] = set()
        self.call_parts = 0

    def begin(self) -> None:
        """A new response (a retry): start its parsing afresh."""
        self.parser = SSEParser(MAX_EVENT_BYTES)
        self.finish = None
        self.done = False
        if not self.offered:  # a call begun by the failed response is not this one's
            self.calls.clear()
            self.call_parts = 0

    async def feed(self, data: bytes) -> None:
        try:
            events = self.parser.feed(data)
        except SSEError as exc:
            raise UpstreamError(
                f"the upstream's event stream is malformed: {exc}", code="upstream_bad_stream"
            ) from None
        for event in events:
            if event == DONE:
                self.done = True
                return
            chunk = parse_chunk(event)
            if chunk.timings is not None:
                self.timings = chunk.timings
            if chunk.prompt_tokens is not None:
                self._prompt(chunk.prompt_tokens)
            if chunk.completion_tokens is not None:
                self.completion_tokens = chunk.completion_tokens
                self.tokens = max(self.tokens, chunk.completion_tokens)
            if chunk.cached_tokens is not None:
                self.cached_tokens = chunk.cached_tokens
            if chunk.finish is not None:
                self.finish = chunk.finish
            if chunk.stop_string in self.assembler.stops:
                self.upstream_stop = chunk.stop_string
            if chunk.reasoning:
                await self._reasoning(chunk.reasoning)
            if chunk.text or chunk.logprobs:
                text = ""
                if chunk.text:
                    await self._end_reasoning()
                    self.pieces += 1
                    text = self.assembler.feed_text(self._within_limit(chunk.text))
                # One entry a piece, so the channel's bound per piece holds.
                entries = chunk.logprobs
                await self.offer(text, 1 if chunk.text else 0, entries[:1])
                for entry in entries[1:]:
                    await self.offer("", 0, (entry,))
                if self.assembler.stopped:
                    # A stop string the upstream let through: end here.
                    self.finish = "stop"
                    self.done = True
                    return
            if chunk.tool_calls:
                await self._end_reasoning()
                await self._gather_calls(chunk.tool_calls)
            if self.max_tokens is not None and self.tokens >= self.max_tokens:
                # An upstream that ignores max_tokens: end at the limit.
                self.finish = "length"
                self.done = self.cut = True
                return
        if events and self._clock is not None:
            # Counted after the offers: waiting for room in the sink is the
            # client's time, not the upstream's silence.
            self.last_event = self._clock()

    def _within_limit(self, text: str) -> str:
        """Count the chunk's tokens (estimated); clip what goes past ``max_tokens``."""
        estimate = max(1, -(-len(text) // MAX_TOKEN_CHARS))
        if self.max_tokens is not None:
            room = self.max_tokens - self.tokens
            if estimate > room:
                estimate = max(1, room)
                text = text[: estimate * MAX_TOKEN_CHARS]
        self.tokens += estimate
        return text

    async def _reasoning(self, text: str) -> None:
        if not self.thinking:
            self.thinking = True
            await self.offer(OPEN, 0)
        self.pieces += 1
        await self.offer(self._within_limit(text), 1)

    async def _end_reasoning(self) -> None:
        if self.thinking:
            self.thinking = False
            await self.offer(CLOSE, 0)

    async def _gather_calls(self, parts: tuple[ToolDelta, ...]) -> None:
        for part in parts:
            call = self.calls.setdefault(part.index, ["", "", ""])
            call[0] = call[0] or part.id or ""
            call[1] = call[1] or part.name or ""
            call[2] += part.arguments
            self.call_parts += 1
            self.pieces += 1
            self.tokens += 1
            if call[1]:
                await self._write_call(part.index)

    async def _write_call(self, index: int) -> None:
        """Write what call ``index`` gathered: its first part (id, name and
        the arguments so far), or the arguments that came since."""
        call_id, name, arguments = self.calls[index]
        first = index not in self.calls_written
        if not first and not arguments:
            return
        tail = self.assembler.flush()  # content held back for a stop string goes first
        if tail:
            await self.offer(tail, 0)
        self.calls_written.add(index)
        call_id_out, name_out = (call_id or None, name) if first else (None, None)
        self.calls[index][2] = ""
        tokens, self.call_parts = self.call_parts, 0
        # In fragments of at most FRAGMENT_CHARS, as the core releases a
        # call's arguments (the channel's bound holds for parts that size).
        for start in range(0, max(len(arguments), 1), FRAGMENT_CHARS):
            fragment = arguments[start : start + FRAGMENT_CHARS]
            if start == 0:
                part = CallPart(index, fragment, call_id_out, name_out)
            else:
                part = CallPart(index, fragment)
            await self._offer_call(part, tokens if start == 0 else 0)

    async def _write_calls(self) -> None:
        """At the end: the calls never named go as they are (the parser
        refuses a call without a name)."""
        for index in sorted(self.calls):
            if index not in self.calls_written:
                await self._write_call(index)

    async def end(self) -> Outcome:
        await self._end_reasoning()
        await self._write_calls()
        tail = self.assembler.flush()
        if tail:
            await self.offer(tail, 0)
        completion = self.completion_tokens if self.completion_tokens is not None else self.pieces
        if self.max_tokens is not None:
            completion = min(completion, self.max_tokens)
        finish = self.finish or "stop"
        # The stop string: ours if we cut the text, else the one the upstream
        # says it stopped at (vLLM does; llama-server does not, and then a
        # stop the upstream made itself is not told from the model's own end).
        stop = self.assembler.stop_string or (self.upstream_stop if finish == "stop" else None)
        return Outcome(
            finish,
            self.prompt_tokens or 0,
            completion,
            upstream_timings=self.timings,
            stop_sequence=stop,
            cached_tokens=self._cached(),
        )

    def _cached(self) -> int:
        """The upstream's cached prompt tokens: its usage's, else llama-server's ``cache_n``."""
        if self.cached_tokens is not None:
            return self.cached_tokens
        cache_n = (self.timings or {}).get("cache_n")
        return int(cache_n) if cache_n is not None else 0

    def _prompt(self, tokens: int) -> None:
        """The upstream counted the prompt: tell the sink at once, so that a
        request cancelled from now on still reports it in its ``done``."""
        if tokens != self.prompt_tokens:
            self.prompt_tokens = tokens
            self.sink.prompt_processed(tokens)

    async def offer(self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """Into the sink in pieces of at most :data:`MAX_PIECE_CHARS` (the
        log-probabilities with the first), waiting (on the loop) while it is full."""
        for start in range(0, max(len(text), 1), MAX_PIECE_CHARS):
            first = start == 0
            await self._offer(
                text[start : start + MAX_PIECE_CHARS],
                tokens if first else 0,
                logprobs if first else (),
            )

    async def _offer(self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]) -> None:
        while not (
            self.sink.offer(text, tokens, logprobs) if logprobs else self.sink.offer(text, tokens)
        ):
            await self._room()
        self.offered = True

    async def _offer_call(self, part: CallPart, tokens: int) -> None:
        while not self.sink.offer_call(part, tokens):
            await self._room()
        self.offered = True

    async def _room(self) -> None:
        """Wait (on the loop) until the full sink has room again."""
        if self.cancel.is_set():
            raise asyncio.CancelledError  # the task's own cancel is on its way
        loop = asyncio.get_running_loop()
        room: asyncio.Future[None] = loop.create_future()
        self.sink.when_room(lambda: call_soon(loop, _resolve, room))
        await room


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    # The loop may already be closed at interpreter shutdown; nothing to tell then.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)

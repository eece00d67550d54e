"""One request's output on its way to its driver: channel → shaper → coalescer → reports.

The pump is the fourth step of a generation (:mod:`.pipeline`). It takes
what the engine put into the request's bounded
:class:`~wsserver.aio.channel.Channel`, has the request's
:class:`~wsserver.shaping.shaper.Shaper` turn it into parts — the answer's text, the
reasoning, the tool calls — lets the :class:`~wsserver.core.pacing.Coalescer`
pace them into frames (the first text at once, then at most one frame per
window, each bounded), and reports each frame
(:class:`~wsserver.core.events.TextProduced`) and, after the last, the request's
end (:class:`~wsserver.core.events.Finished`, with the outcome the shaper made of
the engine's). It moves parts and shapes nothing itself.

While the request is detached (its connection lost, a resume awaited) the
pump takes nothing from the channel: the channel fills and the engine
pauses that request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from ..core import pacing
from ..core.events import Finished, Outcome, PromptCounted, Report, TextProduced
from ..core.pacing import Coalescer
from ..core.protocol import Generate
from ..shaping.shaper import OutputFormat, Shaper
from .channel import Call, Channel, Item, Piece, PromptDone
from .services import Services

__all__ = ["Downstream", "Pump"]


class Downstream(Protocol):
    """Where the pump's reports go: the request's :class:`~.pipeline.Generation`."""

    #: False while the request waits for a resume: take nothing then.
    attached: bool

    async def wait_attached(self) -> bool:
        """Wait while detached; False if the request was stopped meanwhile."""

    async def report(self, event: Report) -> bool:
        """A report for the driver; False if the request has ended."""

    def note(self, event: Report) -> None:
        """A report that sends nothing (the prompt count)."""


class Pump:
    """Moves one request's output from its channel to its driver (:meth:`run`)."""

    __slots__ = ("_channel", "_coalescer", "_count", "_downstream", "_request_id", "_shaper")

    def __init__(
        self,
        request: Generate,
        output: OutputFormat,
        channel: Channel,
        downstream: Downstream,
        services: Services,
    ) -> None:
        """``output``: what the engine said its output for ``request`` looks like."""
        stream = services.config.stream
        self._request_id = request.id
        self._channel = channel
        self._shaper = Shaper(request, output, reasoning_format=stream.reasoning_format)
        self._downstream = downstream
        #: Told each frame's tokens (the tokens metric).
        self._count: Callable[[float], None] = services.metrics.tokens.inc
        self._coalescer = Coalescer(
            flush_window=stream.flush_ms / 1000.0,
            flush_tokens=stream.flush_tokens,
            max_chars=pacing.FRAME_TEXT_CHARS,
        )

    async def run(self) -> None:
        """Channel → shaped parts, coalesced → the driver, then the engine's end."""
        channel = self._channel
        coalescer = self._coalescer
        downstream = self._downstream
        loop = asyncio.get_running_loop()
        while True:
            # Detached: take nothing more (the channel fills, the engine pauses).
            # (Checked inline first: this loop runs per token at full speed.)
            if not downstream.attached and not await downstream.wait_attached():
                return
            if coalescer.due(loop.time()):
                if not await self._flush():
                    return
                continue
            if coalescer.full:
                # A frame's worth of text waits for its window; the rest stays
                # in the bounded channel meanwhile, and the engine pauses.
                wait = max(0.0, coalescer.deadline() - loop.time())
                await asyncio.sleep(wait)  # sleep-ok: the pacing itself, not a synchronisation
                continue
            try:
                # Wait for the window only with text pending: tokens whose bytes
                # are held back (half a character) never make a flush due, and
                # waiting on a past deadline for them would spin.
                if coalescer.has_text:
                    async with asyncio.timeout_at(coalescer.deadline()):
                        item = await channel.get()
                else:
                    item = await channel.get()
            except TimeoutError:
                continue
            if item is None:
                return  # closed: cancelled, or the connection is going
            if not downstream.attached and not await downstream.wait_attached():
                return
            end = self._take(item)
            # Merge whatever else is already waiting: one frame, not many.
            while end is None and not coalescer.full:
                more = channel.get_nowait()
                if more is None:
                    break
                end = self._take(more)
            if end is not None:
                # Tool calls may take more than one frame (each bounded).
                while await self._flush():
                    if not coalescer.pending:
                        await downstream.report(Finished(self._request_id, end))
                        return
                return

    def _take(self, item: Item) -> Outcome | None:
        """One item of the channel into the coalescer, as parts; the request's
        outcome at the engine's end."""
        if isinstance(item, Piece):
            self._shaper.text(self._coalescer, item.text, item.tokens, item.logprobs)
        elif isinstance(item, Call):
            self._shaper.call(self._coalescer, item.part, item.tokens)
        elif isinstance(item, PromptDone):
            prompt = PromptCounted(self._request_id, item.prompt_tokens, item.cached_tokens)
            self._downstream.note(prompt)
        else:
            return self._shaper.end(self._coalescer, item.outcome)
        return None

    async def _flush(self) -> bool:
        """Report everything pending as one text. False if the request has ended."""
        coalescer = self._coalescer
        reasoning, reasoning_tokens = coalescer.take_reasoning()
        tool_calls = coalescer.take_calls()
        text, tokens = coalescer.take(asyncio.get_running_loop().time())
        logprobs = coalescer.take_logprobs()
        self._count(tokens)
        return await self._downstream.report(
            TextProduced(
                self._request_id,
                text,
                tokens,
                reasoning=reasoning,
                reasoning_tokens=reasoning_tokens,
                logprobs=logprobs,
                tool_calls=tool_calls,
            )
        )

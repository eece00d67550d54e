"""Several choices for one prompt on the HTTP exchange (``n`` > 1: docs/openai-api.md, "Several choices").

Theory of operation
-------------------
Each of a request's ``n`` choices runs as a request of its own — its own
:class:`~wsserver.aio.driver.RequestDriver` and session, so its own slot in
the scheduler, bounded channel, pacing, text shaping (reasoning, tool calls)
and one ``done`` — with the frame :func:`choice_frames` makes for it: its
own id, its index, and with a ``seed`` the seed plus its index (modulo
2**32, llama.cpp's seeds; so that seeded choices differ). The engine knows them as one group by
``choice_of`` and shares their prompt's work (the llama engine ingests it
once: :mod:`wsserver.backends.llama_choices`).

:class:`ChoiceMerge` is every choice driver's dialect and writes one answer:

* each ``delta`` goes out (or is gathered) with its choice's index;
* ``queued`` and ``started`` go once (the first of them: the head);
* a choice that finishes has its finish chunk written (streamed) or its
  end kept (whole); when the last one finishes, one end for the whole
  request — the usage counts the prompt once and sums the completions;
* the first choice that fails or is cancelled ends the answer with that
  failure, and the others are cancelled: an answer with a hole in its
  choices is no answer. A client gone cancels every choice (the exchange).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from ..core.protocol import Delta, Done, Error, Generate, Queued, ServerFrame, Started, Usage
from ..dialects.api_errors import ApiError
from ..dialects.exchange import terminal_of
from .driver import RequestDriver

__all__ = ["ChoiceMerge", "check_choices", "choice_frames"]


def check_choices(n: int, slots: int) -> None:
    """Refuse more choices than the model runs at once (its ``parallel``;
    0: no bound): they would wait for one another's slots."""
    if 0 < slots < n:
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"'n' is {n}; this model runs at most {slots} choices at once (its 'parallel')",
            "bad_request",
            "n",
        )


def choice_frames(generate: Generate) -> list[Generate]:
    """The frames of ``generate``'s ``n`` choices: choice 0 keeps its id."""
    return [
        dataclasses.replace(
            generate,
            # '#' is no client's: a choice's id never meets another request's.
            id=generate.id if k == 0 else f"{generate.id}#{k}",
            choice=k,
            seed=None if generate.seed is None else (generate.seed + k) % 2**32,
        )
        for k in range(generate.n)
    ]


class _ChoiceDialect:
    """One choice's driver's dialect: its frames, with its index, to the merge."""

    def __init__(self, merge: ChoiceMerge, index: int) -> None:
        self._merge = merge
        self._index = index

    async def write(self, frame: ServerFrame) -> None:
        await self._merge.write(self._index, frame)


class ChoiceMerge:
    """The choices' frames merged into one answer (see the module docstring)."""

    def __init__(
        self,
        n: int,
        *,
        write: Callable[[ServerFrame], Awaitable[None]],
        finish: Callable[[Done, int], Awaitable[None]],
    ) -> None:
        self._n = n
        #: The dialect's own writer: the head, the chunks, the one end.
        self._write = write
        #: Writes the end of one choice (a finish chunk, a ``choice_done``).
        self._finish = finish
        self._ends: dict[int, Done] = {}
        self._heads: set[type[ServerFrame]] = set()
        #: The answer's end is written (or being written): nothing more goes out.
        self.over = False
        self.drivers: list[RequestDriver] = []

    def dialect(self, index: int) -> _ChoiceDialect:
        return _ChoiceDialect(self, index)

    async def write(self, index: int, frame: ServerFrame) -> None:
        if self.over:
            return
        if isinstance(frame, Delta):
            await self._write(dataclasses.replace(frame, choice=index))
        elif isinstance(frame, Queued | Started):
            if type(frame) not in self._heads:
                self._heads.add(type(frame))
                await self._write(frame)
        elif isinstance(frame, Done) and terminal_of(frame) == "finished":
            self._ends[index] = frame
            await self._finish(frame, index)
            if len(self._ends) == self._n:
                self.over = True
                await self._write(self._whole())
        elif isinstance(frame, Done | Error):
            # The first failure ends the answer; the other choices are cancelled.
            self.over = True
            self.cancel_all()
            await self._write(frame)

    def cancel_all(self) -> None:
        """Cancel every choice that runs (or waits for the model)."""
        for driver in self.drivers:
            driver.cancel_soon()

    def _whole(self) -> Done:
        """The request's end: choice 0's, its usage the prompt once and every
        choice's completion tokens summed."""
        first = self._ends[0]
        ends = self._ends.values()
        usage = Usage(
            prompt_tokens=first.usage.prompt_tokens,
            completion_tokens=sum(done.usage.completion_tokens for done in ends),
            reasoning_tokens=sum(done.usage.reasoning_tokens for done in ends),
            cached_tokens=first.usage.cached_tokens,
        )
        return dataclasses.replace(first, usage=usage)

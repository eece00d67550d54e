"""The backend seam: what a model must provide to be served.

A backend is synchronous and runs on producer threads, never on the event
loop. The server calls :meth:`Backend.load` once (on a thread) before serving,
then :meth:`Backend.generate` on a request's own producer thread, with a *slot*
(one of ``Backend.slots`` model contexts; the server's scheduler guarantees a
slot is used by one producer at a time).

``generate`` reports through a :class:`TokenSink`. ``sink.emit()`` blocks while
the connection's channel is full (that is the backpressure) and raises
:class:`~wsserver.errors.GenerationCancelled` when the request is cancelled or
the client went away, or :class:`~wsserver.errors.GenerationStalled` when the
client has not read for the stall timeout. Backends let both propagate. A
backend that can be interrupted inside a long computation (a prompt prefill)
should also watch ``cancel``, a :class:`threading.Event` set on cancel.

Third-party exceptions are translated at this seam: a backend raises
:class:`~wsserver.errors.BackendError` (or lets the producer wrap anything
unexpected as ``internal``); exception text never reaches the client.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Protocol

from ..protocol import Generate, Message
from ..session import Outcome

__all__ = ["Backend", "GenerationRequest", "Outcome", "TokenSink"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request with the server's defaults filled in."""

    id: str
    prompt: str | None
    messages: tuple[Message, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]

    @classmethod
    def from_frame(cls, frame: Generate, *, default_max_tokens: int) -> GenerationRequest:
        return cls(
            id=frame.id,
            prompt=frame.prompt,
            messages=frame.messages,
            max_tokens=frame.max_tokens if frame.max_tokens is not None else default_max_tokens,
            temperature=0.8 if frame.temperature is None else frame.temperature,
            top_p=0.95 if frame.top_p is None else frame.top_p,
            top_k=40 if frame.top_k is None else frame.top_k,
            seed=frame.seed,
            stop=frame.stop,
        )


class TokenSink(Protocol):
    """Where a producer puts its output. Implemented by the server's channel."""

    def prompt_processed(self, prompt_tokens: int) -> None:
        """Report the prompt's token count once it is known."""

    def emit(self, text: str, tokens: int = 1) -> None:
        """Hand over final text for ``tokens`` generated tokens.

        ``text`` may be empty when a token's bytes are held back (a partial
        character or a possible stop string); the token still counts.
        """


class Backend(abc.ABC):
    """A model that can stream completions."""

    #: Shown to clients in ``hello``.
    model_name: str = "unknown"
    #: How many generations may run at once (contexts); 0 = no limit.
    slots: int = 0
    #: How many requests may wait for a slot before ``overloaded``.
    max_waiting: int = 64

    def load(self) -> None:
        """Load the model. Blocking; called once on a worker thread."""
        return None  # a backend with nothing to load needs no override

    def close(self) -> None:
        """Release the model. Called once at shutdown, after every producer ended."""
        return None

    @abc.abstractmethod
    def generate(
        self,
        request: GenerationRequest,
        *,
        slot: int,
        sink: TokenSink,
        cancel: threading.Event,
    ) -> Outcome:
        """Generate the completion for ``request`` into ``sink``.

        Returns how it ended (reason ``stop`` or ``length`` with token counts).
        Raises what ``sink.emit`` raises, or :class:`BackendError`.
        """

    def count_prompt_tokens(self, request: GenerationRequest) -> int | None:
        """The prompt's token count if cheap to know before generating, else None."""
        return None

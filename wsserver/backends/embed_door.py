"""The seam's embedding door: how an engine takes embedding and rerank requests.

An engine that embeds hands out one :class:`EmbedDoor` per loaded model
(:meth:`~wsserver.backends.base.Backend.embeddings`; None: it embeds
nothing, and the asyncio layer refuses by name). A request goes through it
in two moves, as a generation goes through :meth:`~.base.Backend.prepare`
and :meth:`~.base.Backend.submit`: :meth:`EmbedDoor.prepare` on a worker
thread once the request holds one of the model's slots (the inputs
tokenized and bounded: a refusal is a
:class:`~wsserver.errors.ProtocolError`), then :meth:`EmbedDoor.start` on the
event loop, which returns an :class:`EmbedSubmission` at once. The engine
completes it once: with the vectors or scores, with an error, or —
cancelled — with neither, within one of its steps (docs/embeddings.md).
"""

from __future__ import annotations

import abc

from ..core.embedding import Embed, Embedded
from ..errors import WireCode
from .handles import CancelEvent, Submission

__all__ = ["EmbedDoor", "EmbedSubmission"]


class EmbedSubmission(Submission):
    """The handle of one embedding request: the engine completes it once,
    with the result (:meth:`finish`) or a wire code and message
    (:meth:`fail`) — or, cancelled, with neither, within one step."""

    def __init__(self) -> None:
        super().__init__()
        self.result: Embedded | None = None
        self.error: tuple[WireCode, str] | None = None

    def finish(self, result: Embedded) -> None:
        if not self.done:
            self.result = result
        self.complete()

    def fail(self, code: WireCode, message: str) -> None:
        if not self.done:
            self.error = (code, message)
        self.complete()


class EmbedDoor(abc.ABC):
    """A loaded model's embedding work: what it serves, and the way in."""

    @property
    @abc.abstractmethod
    def kind(self) -> str:
        """``"embed"`` (vectors) or ``"rerank"`` (a reranker's scores). Quick."""

    def prepare(self, request: Embed) -> Embed:
        """``request``'s inputs as the engine will read them, checked (the
        llama engine tokenizes and bounds them here); called on a worker
        thread, before :meth:`start`. Raises
        :class:`~wsserver.errors.ProtocolError` to refuse it."""
        return request

    @abc.abstractmethod
    def start(self, request: Embed, *, cancel: CancelEvent) -> EmbedSubmission:
        """Start the prepared ``request``: on the event loop, returning at once."""

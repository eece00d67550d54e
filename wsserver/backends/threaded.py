"""The thread-per-request engine adapter: a blocking ``generate()`` on a thread
of its own per request (the seam's first kind of engine, :mod:`.base`)."""

from __future__ import annotations

import abc
import logging
import threading

from ..core.events import Outcome
from ..errors import BackendError, GenerationCancelled
from ..logs import context
from .base import Backend, CancelEvent, GenerationRequest, Sink, Submission, TokenSink

__all__ = ["ThreadedBackend"]

log = logging.getLogger("wsserver.producer")


class _ThreadSubmission(Submission):
    def __init__(self) -> None:
        super().__init__()
        self.thread: threading.Thread | None = None

    def alive(self) -> bool:
        thread = self.thread
        return thread is not None and thread.is_alive()

    def join(self, timeout: float) -> None:
        # ``complete`` runs in the thread's last lines; the thread itself ends
        # a moment later. Joining makes "stopped" mean gone.
        if self.thread is not None:
            self.thread.join(timeout)


class ThreadedBackend(Backend):
    """The thread-per-request adapter: :meth:`generate` on a thread of its own.

    The thread reports how the request ended into the sink — the outcome
    ``generate`` returned, or the wire code of a :class:`BackendError`
    (anything else is logged here and reported as ``internal``); a cancel ends
    it quietly, the client having had its ``done`` already. It completes the
    submission in its last lines.
    """

    @abc.abstractmethod
    def generate(
        self,
        request: GenerationRequest,
        *,
        slot: int,
        sink: TokenSink,
        cancel: threading.Event,
    ) -> Outcome:
        """Generate the completion for ``request`` into ``sink``, blocking.

        Returns how it ended (reason ``stop`` or ``length`` with token counts).
        Raises what ``sink.emit`` raises, or :class:`BackendError`.
        """

    def submit(
        self, request: GenerationRequest, *, slot: int, sink: Sink, cancel: CancelEvent
    ) -> Submission:
        submission = _ThreadSubmission()

        def produce() -> None:
            try:
                sink.end(self.generate(request, slot=slot, sink=sink, cancel=cancel))
            except GenerationCancelled:
                pass
            except BackendError as exc:
                sink.end(Outcome(reason="error", error_code=exc.code, error_message=str(exc)))
            except Exception:
                # Unexpected: log the traceback here; the client only gets "internal".
                log.exception(
                    "id=%s backend failed", request.id, extra=context(request.conn_id, request.id)
                )
                sink.end(
                    Outcome(
                        reason="error", error_code="internal", error_message="the backend failed"
                    )
                )
            finally:
                submission.complete()

        submission.thread = threading.Thread(
            target=produce, name=f"wsserver-producer-{request.conn_id}-{request.id}", daemon=True
        )
        submission.thread.start()
        return submission

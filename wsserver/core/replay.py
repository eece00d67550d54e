"""What a resumable request keeps for a replay (sans-I/O).

A resumed client says which ``delta`` it saw last (``after_seq``); the server
must then send the ones after it that may not have arrived. Those are the
frames *sent but unconfirmed*: in websockets' write buffer (our sends wait
above ``server.write_limit``), in the kernel's send queue (``server.sndbuf``,
doubled by Linux) and in the client's own receive buffers. Nothing else has
to be kept — while the client is away its request stops being read, the
bounded channel fills and the engine pauses — so :class:`ReplayTail` keeps
the newest sent deltas up to a budget in *wire bytes* (their serialized
size), which the server sizes from those send-side bounds
(:func:`wsserver.aio.peer.resume_tail_bytes`). An ``after_seq`` older than
the tail is refused (``seq_out_of_range``) rather than answered with a gap.
"""

from __future__ import annotations

from collections import deque

from ..errors import ProtocolError
from .protocol import Delta, serialize

__all__ = ["ReplayTail"]


class ReplayTail:
    """The newest ``delta`` frames of one request, at most ``budget`` wire bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._frames: deque[tuple[Delta, int]] = deque()
        #: Wire bytes of the frames kept (always <= ``budget``).
        self.bytes = 0

    def add(self, frame: Delta) -> None:
        """Keep a delta that was handed to the socket; drop the oldest over budget."""
        size = len(serialize(frame))
        self._frames.append((frame, size))
        self.bytes += size
        while self._frames and self.bytes > self.budget:
            _, dropped = self._frames.popleft()
            self.bytes -= dropped

    def first_seq(self, next_seq: int) -> int:
        """The oldest seq still kept (``next_seq``, the seq the request's next
        delta will carry — its record keeps it —, when nothing is)."""
        return self._frames[0][0].seq if self._frames else next_seq

    def after(self, after_seq: int, next_seq: int, request_id: str) -> list[Delta]:
        """The frames after ``after_seq``; refused if some of them are gone,
        or if ``after_seq`` names a delta that was never sent (``next_seq``:
        the seq of the request's next delta)."""
        first = self.first_seq(next_seq)
        if not first - 1 <= after_seq <= next_seq - 1:
            raise ProtocolError(
                "seq_out_of_range",
                f"after_seq must be between {first - 1} and {next_seq - 1}"
                " (older deltas are no longer kept)",
                request_id,
            )
        return [frame for frame, _ in self._frames if frame.seq > after_seq]

    def __len__(self) -> int:
        return len(self._frames)

"""One HTTP exchange, sans-I/O: how every HTTP dialect's answer ends.

Theory of operation
-------------------
An HTTP dialect (OpenAI's chat completions and completions, the Responses
API, Anthropic's Messages API, Ollama's API — and the next one) is a body parser and a
:class:`Renderer`, nothing else. The parser turns a request body into the
core's :class:`~wsserver.core.protocol.Generate`; the request driver runs it, and
the frames it gives back go to the renderer, which turns them into the
dialect's bytes: the chunk of each ``delta`` (streamed) or the gathered text
(whole), the stream's last events, the whole body, an error event in the
stream, an error as the whole answer. The asyncio half
(:mod:`wsserver.aio.exchange`) resolves the model, runs the driver, writes
the bytes, and turns a lost client or the server's shutdown into a cancel.

*Where* an answer's end goes is no dialect's business: it depends only on how
the request ended, whether it streams, and whether the stream's head is out
already — one table, :data:`ENDINGS`, for every dialect:

==========================  ===========  ==============  ===========
outcome                     streamed,    streamed, head  whole
                            head sent    not sent yet
==========================  ===========  ==============  ===========
finished (stop, length,     last events  last events     body, 200
tool_calls)                 (200)        (head first)
cancelled (a shutdown)      error event  error, 503      error, 503
error (refused or failed)   error event  error, status   error, status
context_length_exceeded     error event  error, 400      error, 400
==========================  ===========  ==============  ===========

Some cells are impossible by construction, and the table still answers them
(so that a new path cannot crash a writer): a stream's head goes out when its
request waits or starts, so a stream never *finishes* before its head; the
engine refuses a prompt beyond the context before anything is sent. A whole
answer sends its head with its body, so it has no "head sent" column. "Status"
is the wire code's (:func:`~wsserver.dialects.api_errors.status_of`) unless the table
names one; a dialect may write a status its own way (Anthropic's 529).

Only a shutdown cancels a request whose client is still there to read the
answer (a client that left is a cancel nobody reads): hence its message,
:data:`SHUTTING_DOWN`, written here once for every dialect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import orjson

from ..core.protocol import Delta, Done, Error
from ..errors import CONTEXT_LENGTH_EXCEEDED, WireCode
from .api_errors import status_of

__all__ = [
    "ENDINGS",
    "KEEPALIVE",
    "SHUTTING_DOWN",
    "Ending",
    "Failure",
    "Placement",
    "Renderer",
    "Terminal",
    "ending",
    "failure_of",
    "sse",
    "sse_events",
    "terminal_of",
]

#: How a request ended, as far as its answer's end is concerned.
Terminal = Literal["finished", "cancelled", "error", "context_length_exceeded"]
#: Where the end goes: the stream's last events, the whole body (200), an
#: error event that ends the stream, or an error as the whole answer.
Placement = Literal["last", "body", "error_in_band", "error_whole"]

#: The one table: (outcome, streamed, head sent) → placement, and the status
#: (None: the wire code's own). See the module docstring.
ENDINGS: Final[dict[tuple[Terminal, bool, bool], tuple[Placement, int | None]]] = {
    ("finished", True, True): ("last", 200),
    # Never: `started` sends the head before any text; the head goes first.
    ("finished", True, False): ("last", 200),
    ("finished", False, False): ("body", 200),
    ("cancelled", True, True): ("error_in_band", 503),
    ("cancelled", True, False): ("error_whole", 503),
    ("cancelled", False, False): ("error_whole", 503),
    ("error", True, True): ("error_in_band", None),
    ("error", True, False): ("error_whole", None),
    ("error", False, False): ("error_whole", None),
    # Never: the engine refuses such a prompt before anything is sent.
    ("context_length_exceeded", True, True): ("error_in_band", 400),
    ("context_length_exceeded", True, False): ("error_whole", 400),
    ("context_length_exceeded", False, False): ("error_whole", 400),
}

#: A cancelled request's message: only the server's shutdown cancels one
#: whose client still reads.
SHUTTING_DOWN: Final = "the server is shutting down"

#: A comment line: ignored by every SSE client, it keeps proxies and clients
#: from timing out a stream that waits for the model.
KEEPALIVE: Final = b": keep-alive\n\n"


def sse(event: dict[str, Any]) -> bytes:
    """One typed event as Server-Sent Events: its ``event:`` name, its JSON
    (the Responses API's and the Messages API's streams)."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def sse_events(events: list[dict[str, Any]]) -> bytes:
    """Typed events as one write."""
    return b"".join(sse(event) for event in events)


@dataclass(frozen=True, slots=True)
class Failure:
    """A request that did not run to its end, as its answer tells it."""

    #: The HTTP status (OpenAI's; a dialect may write its own for it).
    status: int
    #: The wire code (``cancelled``, ``overloaded``, ``context_length_exceeded``, …).
    code: str
    message: str
    #: The engine's end, for a request that ran (``None``: refused before it
    #: ran); a dialect whose stream has terminal events of its own writes it so.
    done: Done | None = None


@dataclass(frozen=True, slots=True)
class Ending:
    """The end of an answer, as the exchange writes it."""

    #: In the stream (its head sent already, or sent now); else the whole answer.
    in_stream: bool
    status: int
    data: bytes


def terminal_of(frame: Done | Error) -> Terminal:
    """The outcome a terminal frame stands for."""
    if isinstance(frame, Error):
        return "context_length_exceeded" if frame.detail == CONTEXT_LENGTH_EXCEEDED else "error"
    if frame.reason == "cancelled":
        return "cancelled"
    return "error" if frame.reason == "error" else "finished"


def failure_of(frame: Done | Error, status: int | None = None) -> Failure:
    """What a request that did not run to its end says: a refusal (``error``),
    a failed or cancelled one (``done``), with ``status`` — by default the
    table's (a row's is the same in every column), else the wire code's."""
    done: Done | None = None
    if isinstance(frame, Done):
        done = frame
        if frame.reason == "cancelled":
            code: str = "cancelled"
            message = SHUTTING_DOWN
        else:
            code = frame.error_code or "internal"
            message = frame.error_message or "generation failed"
    elif frame.detail == CONTEXT_LENGTH_EXCEEDED:
        # OpenAI's code for a prompt beyond the context (the WebSocket
        # protocol keeps ``too_large``).
        code, message = CONTEXT_LENGTH_EXCEEDED, frame.message
    else:
        code, message = frame.code, frame.message
    if status is None:
        status = ENDINGS[terminal_of(frame), False, False][1]
    if status is None:
        status = status_of(cast("WireCode", code))
    return Failure(status, code, message, done)


class Renderer:
    """One HTTP dialect's answer to one request, sans-I/O: the core's frames
    in, the dialect's bytes out. A dialect subclasses it; the exchange calls
    the streamed half (:meth:`started`, :meth:`chunk`, :meth:`last`,
    :meth:`error_event`) or the whole half (:meth:`gather`, :meth:`body`,
    :meth:`error_body`) as :attr:`stream` says, and :func:`ending` decides
    which of the ends it is."""

    #: Streamed (SSE) or whole (one body).
    stream: bool = False
    #: What a waiting stream sends while nothing else is sent (the Messages
    #: API's ``ping`` event; else a comment; nothing: ``b""``).
    keepalive: bytes = KEEPALIVE
    #: A streamed answer's content type (Ollama's is newline-delimited JSON).
    media_type: str = "text/event-stream; charset=utf-8"

    def prompt_counted(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The engine counted the prompt (the Messages API's ``message_start`` has it)."""

    def refusal_wording(self, message: str) -> str:
        """A refusal's message in the dialect's names (its fields are named
        differently from the core's)."""
        return message

    # ------------------------------------------------------------ streamed

    def started(self) -> bytes:
        """What goes out after the head once the engine is the request's."""
        return b""

    def chunk(self, delta: Delta) -> bytes:
        """One ``delta`` as the stream's bytes (reasoning, text, tool call parts);
        ``b""``: nothing to write for it yet (a dialect that sends a call whole)."""
        raise NotImplementedError

    def choice_done(self, done: Done, index: int) -> bytes:
        """Choice ``index`` of a request for several (``n``: only OpenAI's
        dialect has it) ran to its end: what its stream writes now (b"": nothing)."""
        return b""

    def last(self, done: Done) -> bytes:
        """The stream's last bytes, for a request that ran to its end."""
        raise NotImplementedError

    def error_event(self, failure: Failure) -> bytes:
        """The error event that ends a stream whose head is out."""
        raise NotImplementedError

    # ------------------------------------------------------------ whole

    def gather(self, delta: Delta) -> None:
        """Keep one ``delta`` for the whole body."""
        raise NotImplementedError

    def body(self, done: Done) -> bytes:
        """The whole body (200), for a request that ran to its end."""
        raise NotImplementedError

    def error_body(self, failure: Failure) -> tuple[int, bytes]:
        """A failure as the whole answer: its status (the dialect's) and body."""
        raise NotImplementedError


def ending(renderer: Renderer, frame: Done | Error, *, head_sent: bool) -> Ending:
    """How the answer to a request that ended with ``frame`` ends (:data:`ENDINGS`)."""
    stream = renderer.stream
    placement, status = ENDINGS[terminal_of(frame), stream, stream and head_sent]
    if placement == "last":
        assert isinstance(frame, Done)
        return Ending(True, 200, renderer.last(frame))
    if placement == "body":
        assert isinstance(frame, Done)
        return Ending(False, 200, renderer.body(frame))
    failure = failure_of(frame, status)
    if isinstance(frame, Error):
        failure = Failure(failure.status, failure.code, renderer.refusal_wording(failure.message))
    if placement == "error_in_band":
        return Ending(True, failure.status, renderer.error_event(failure))
    status, body = renderer.error_body(failure)
    return Ending(False, status, body)

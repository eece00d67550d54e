"""The sans-I/O core of both Python clients: requests, their frames, their rules.

The async client (:mod:`wsserver_client.client`) and the sync client
(:mod:`wsserver_client.sync`) differ only in how they move bytes. Everything
else lives here, once, with no socket, no asyncio and no websockets:

* building the ``generate``, ``restart`` and ``cancel`` frames and the IDs;
* routing each server frame by its request ID to a :class:`Request`;
* what a delta carries besides the answer's text: the model's reasoning
  (:attr:`Request.reasoning`) and its tool calls, joined from their parts
  (:attr:`Request.tool_calls`, each a :class:`ToolCall` that parses its
  arguments or says why they do not parse), and the same in order as typed
  events (:class:`Text`, :class:`Reasoning`, :class:`ToolCallDelta`) for
  :meth:`Request.event_pieces`;
* the late-frame rule: once the caller cancels or restarts a request
  (:meth:`Request.abandon`), none of its text reaches the caller any more —
  neither frames still on the wire nor text already received but not yet
  read. Its ``done`` is still recorded, because the protocol makes ``done``
  the last frame of an ID;
* failing every live request when the connection is lost — except a
  *resumable* one (its ``started`` carried a ``resume_token``): that one is
  kept, and after a reconnect :meth:`RequestTable.resume_frames` asks the
  server to replay what may not have arrived (``after_seq`` = the last
  ``seq`` received) and go on; deltas the client already has are dropped, so
  the caller's text has no gap and no duplicate;
* a ``pull`` (:class:`PullRequest`): a model downloaded onto the server,
  its progress in order, its one ``pull_done``; not resumed on a lost
  connection (it fails with ``connection_lost``; pulling again resumes the
  file on the server);
* when to reconnect, how long to wait before each try, when to ask again
  after a refused ``resume`` and when to give up: the policy of
  :mod:`wsserver_client.reconnect`, applied by :meth:`RequestTable.lost`,
  :meth:`RequestTable.reconnect_waits` and :meth:`RequestTable.retry_wait`.

An I/O layer feeds received messages to :meth:`RequestTable.receive`, sends
the frames this module builds, and iterates :meth:`Request.pieces` (the
answer's text) or :meth:`Request.event_pieces` (every event), waiting (in its own
way) whenever it has nothing yet. A subclass of
:class:`Request` can override :meth:`Request.changed` to be woken. The table
reads the time from the clock it is given (``time.monotonic``), only to
measure how long ago a connection was lost; the I/O layer does the waiting.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from wsserver.core.embedding import floats_of
from wsserver.core.protocol import (
    ChoiceDone,
    Delta,
    Done,
    EmbedDone,
    Error,
    Hello,
    Progress,
    PullDone,
    Pulling,
    Queued,
    Resumed,
    ServerFrame,
    Started,
    parse_server_frame,
)

from .reconnect import (
    RECONNECT_GAVE_UP,
    RESUME_GAVE_UP,
    ReconnectPolicy,
    keeps_on_loss,
    resume_frame,
    retries_refusal,
)

__all__ = [
    "EmbedRequest",
    "Embedding",
    "Event",
    "GenerationError",
    "PullRequest",
    "Reasoning",
    "Request",
    "RequestResult",
    "RequestTable",
    "Text",
    "ToolCall",
    "ToolCallDelta",
]


class GenerationError(Exception):
    """The server refused a request (``error`` frame) or the connection dropped.

    ``code`` is the server's wire code (``busy``, ``unknown_id``,
    ``bad_request``, …) or ``connection_lost`` when the connection closed
    while the request was live.
    """

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class ToolCall:
    """One tool call of the model, as joined from its parts so far.

    The server sends a call's ``id`` and function ``name`` first, then its
    ``arguments`` as JSON text in fragments (docs/protocol.md, "Tool calls");
    once the request has ended, :attr:`arguments` is the whole text.
    :attr:`parsed_arguments` is that text parsed (``None`` while it does not
    parse), :attr:`arguments_error` why it does not parse (``None`` when it
    does): the server checks a call before it sends it, so an error here means
    an incomplete call (the request was cancelled mid-call, or cut off by
    ``max_tokens``: ``done`` reason ``length``) or a server that
    does not check (a relay's upstream, an older server).
    """

    #: The call's position among the turn's calls (0, 1, …).
    index: int
    #: The call's id, which a ``tool`` message with the result names.
    id: str
    #: The function called (one of the request's ``tools``).
    name: str
    #: The arguments' JSON text, joined from the parts received.
    arguments: str = ""

    @property
    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a JSON object, or ``None`` if they are not one."""
        value, _ = self._parse()
        return value

    @property
    def arguments_error(self) -> str | None:
        """Why :attr:`arguments` is not a JSON object (``None`` if it is)."""
        _, error = self._parse()
        return error

    def _parse(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            value = json.loads(self.arguments)
        except ValueError as exc:
            return None, f"the arguments are not valid JSON: {exc}"
        if not isinstance(value, dict):
            return None, f"the arguments are JSON but not an object: {type(value).__name__}"
        return value, None

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (OpenAI's shape)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class Text:
    """A piece of the answer's text."""

    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A piece of the model's reasoning (its think block), which comes before
    the answer (docs/protocol.md, "Reasoning")."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A part of a tool call arrived: ``arguments`` is the text it added
    (the first part of a call brings its ``id`` and ``name``, maybe no text
    yet); ``call`` is the call it belongs to, the same object for every part
    of it, which keeps growing as later parts arrive."""

    call: ToolCall
    arguments: str


#: What :meth:`Request.events` yields, in the order the server sent it.
Event = Text | Reasoning | ToolCallDelta


@dataclass
class RequestResult:
    """A finished request: its whole text and its ``done`` frame, with the
    model's reasoning and its tool calls (``done.reason == "tool_calls"``)."""

    id: str
    text: str
    done: Done
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The answer as the assistant message of a chat's next request:
        ``content`` (``None`` beside tool calls when there is no text), its
        ``tool_calls`` and, with calls, its ``reasoning``: the tool-use loop
        goes on, and chat templates show that turn's reasoning (an answer
        without calls ends the turn, whose reasoning templates leave out)."""
        if not self.tool_calls:
            return {"role": "assistant", "content": self.text}
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.text or None,
            "tool_calls": [call.message() for call in self.tool_calls],
        }
        if self.reasoning:
            message["reasoning"] = self.reasoning
        return message


class Request:
    """One request's state: what arrived, what the caller has not read yet."""

    def __init__(self, request_id: str, frame: dict[str, Any]) -> None:
        self.id = request_id
        #: The frame that starts the request (``generate`` or ``restart``).
        self.frame = frame
        #: Binary frames to send before it: its images' uploads (emptied once sent).
        self.uploads: list[bytes] = []
        #: The server's ``done`` frame, once it arrived.
        self.done: Done | None = None
        #: Why the request ended without a ``done`` (refused, connection lost).
        self.error: GenerationError | None = None
        self.started = False
        #: Every queue position the server reported, in order.
        self.positions: list[int] = []
        #: The deltas received before the request ended or was abandoned.
        self.deltas: list[Delta] = []
        #: The ``choice_done`` of each ended choice (a request for several: ``n``).
        self.choice_ends: list[ChoiceDone] = []
        self.sent = False
        #: Set by ``started`` for a resumable request: what a resume presents.
        self.resume_token: str | None = None
        #: True from a lost connection to the server's ``resumed``.
        self.suspended = False
        #: When (the table's clock) the connection this request is suspended
        #: from was lost: the reconnect policy's budget runs from there.
        self.lost_at = 0.0
        #: True between a reconnect's ``resume`` and the server's answer.
        self.resuming = False
        #: ``resume`` frames sent for this request (the retries back off).
        self.resume_attempts = 0
        #: The server still held the request for the lost connection
        #: (``already_attached``): the I/O layer tries the resume again.
        self.retry_resume = False
        self._abandoned = False
        # The server answered the request frame (queued, started or text): an
        # error after that is about a later frame of ours, i.e. our cancel.
        self._acknowledged = False
        #: The model's tool calls, in order, joined from their parts so far.
        self.tool_calls: list[ToolCall] = []
        self._calls: dict[int, ToolCall] = {}
        self._unread: deque[Event] = deque()

    @property
    def text(self) -> str:
        """All text received (the caller may not have read all of it); of a
        request for several choices (``n``), every choice's, as it came."""
        return "".join(d.text for d in self.deltas)

    def choice_texts(self) -> list[str]:
        """Each choice's text so far, by index, of a request for several
        choices (``generate(..., n=3)``; docs/protocol.md, "Several choices");
        ``choice_ends`` has each ended choice's ``choice_done``."""
        texts: dict[int, list[str]] = {}
        for delta in self.deltas:
            texts.setdefault(delta.choice or 0, []).append(delta.text)
        return ["".join(texts.get(k, ())) for k in range(max(texts, default=-1) + 1)]

    @property
    def reasoning(self) -> str:
        """All reasoning received (a think block the server kept apart from
        the text: ``reasoning_format`` "auto")."""
        return "".join(d.reasoning or "" for d in self.deltas)

    @property
    def abandoned(self) -> bool:
        """True once the caller cancelled or restarted this request."""
        return self._abandoned

    @property
    def finished(self) -> bool:
        """True once ``done`` arrived or the request failed."""
        return self.done is not None or self.error is not None

    @property
    def ended(self) -> bool:
        """True when iteration can yield nothing more (but may still raise)."""
        return not self._unread and (self.finished or self._abandoned)

    @property
    def ready(self) -> bool:
        """True when :meth:`take` has text or the request :attr:`ended`: what
        an I/O layer waits for."""
        return bool(self._unread) or self.finished or self._abandoned

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the last delta received (-1: none)."""
        return self.deltas[-1].seq if self.deltas else -1

    @property
    def resumable(self) -> bool:
        """True if a lost connection keeps this request (it can be resumed)."""
        return self.resume_token is not None and not self.finished

    def take(self) -> str | None:
        """The next piece of text for the caller, or ``None`` if there is none
        yet. Events that are not text (reasoning, tool calls) are passed over:
        read them from :attr:`reasoning` and :attr:`tool_calls`, or take
        every event with :meth:`take_event` instead."""
        while self._unread:
            event = self._unread.popleft()
            if isinstance(event, Text):
                return event.text
        return None

    def take_event(self) -> Event | None:
        """The next event for the caller, or ``None`` if there is none yet."""
        return self._unread.popleft() if self._unread else None

    def pieces(self) -> Iterator[str | None]:
        """Iteration without the waiting: each piece of text in turn, or
        ``None`` when there is none yet (the I/O layer waits until
        :attr:`ready`, then asks for the next). Ends with the request, raising
        its :class:`GenerationError` if it failed."""
        while not self.ended:
            yield self.take()
        self.raise_for_error()

    def event_pieces(self) -> Iterator[Event | None]:
        """:meth:`pieces` for every event: the answer's text, the reasoning
        and the tool calls' parts, in the order the server sent them."""
        while not self.ended:
            yield self.take_event()
        self.raise_for_error()

    def raise_for_error(self) -> None:
        """Raise the request's :class:`GenerationError`, if it failed and the
        caller still wanted it (an abandoned request ends quietly)."""
        if self.error is not None and not self._abandoned:
            raise self.error

    def finished_result(self) -> RequestResult:
        """The finished request (call once it is :attr:`finished`); raises if it
        ended without a ``done``."""
        if self.done is None:
            raise self.error or GenerationError("internal", "the request has not ended", self.id)
        return RequestResult(
            id=self.id,
            text=self.text,
            done=self.done,
            reasoning=self.reasoning,
            tool_calls=list(self.tool_calls),
        )

    def changed(self) -> None:
        """Called after text arrived or the request ended; a hook for I/O layers."""

    # ------------------------------------------------------------ table side

    def deliver(self, frame: ServerFrame) -> None:
        """Apply one server frame of this request."""
        if self.finished:
            return
        if isinstance(frame, Delta):
            self._acknowledged = True
            if frame.seq <= self.last_seq:
                return  # replayed after a resume, and already here
            if not self._abandoned:  # a late frame of a cancelled request is dropped
                self.deltas.append(frame)
                self._unread.extend(self._events(frame))
                self.changed()
        elif isinstance(frame, Queued):
            self._acknowledged = True
            self.positions.append(frame.position)
        elif isinstance(frame, Started):
            self._acknowledged = True
            self.started = True
            self.resume_token = frame.resume_token
        elif isinstance(frame, Resumed):
            self.resuming = False
            self.suspended = False
            self.resume_attempts = 0
        elif isinstance(frame, ChoiceDone):
            self.choice_ends.append(frame)
        elif isinstance(frame, Done):
            self.done = frame
            self.changed()
        elif isinstance(frame, Error):
            if self._abandoned and self._acknowledged and frame.code == "rate_limited":
                return  # our cancel was refused; the request runs on and its done comes
            if retries_refusal(frame.code, resuming=self.resuming):
                # The server has not yet seen the old connection go.
                self.resuming = False
                self.retry_resume = True
                self.changed()
                return
            self.resuming = False
            self.fail(GenerationError(frame.code, frame.message, frame.id))

    def _events(self, frame: Delta) -> Iterator[Event]:
        """A delta's events in the protocol's order (reasoning, text, calls),
        joining each call part to its call."""
        if frame.reasoning:
            yield Reasoning(frame.reasoning)
        if frame.text:
            yield Text(frame.text)
        for part in frame.tool_calls or ():
            call = self._calls.get(part.index)
            if call is None:
                call = ToolCall(part.index, part.id or "", part.name or "")
                self._calls[part.index] = call
                self.tool_calls.append(call)
            call.arguments += part.arguments
            yield ToolCallDelta(call, part.arguments)

    def abandon(self) -> None:
        """The caller gave up: text not yet read is dropped, and so is any to come."""
        self._abandoned = True
        self._unread.clear()
        self.changed()

    def fail(self, error: GenerationError) -> None:
        if not self.finished:
            self.error = error
            self.changed()


class PullRequest:
    """One ``pull``: its progress reports in order, then its ``pull_done``."""

    def __init__(self, request_id: str, frame: dict[str, Any]) -> None:
        self.id = request_id
        self.frame = frame
        self.sent = False
        #: The server's ``pull_done``, once it arrived.
        self.done: PullDone | None = None
        #: Why the pull ended without one (refused, connection lost).
        self.error: GenerationError | None = None
        #: The last progress reported.
        self.progress: Progress | None = None
        self._unread: deque[Progress] = deque()

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    @property
    def ready(self) -> bool:
        """True when :meth:`take` has a report or the pull has ended."""
        return bool(self._unread) or self.finished

    def take(self) -> Progress | None:
        return self._unread.popleft() if self._unread else None

    def reports(self) -> Iterator[Progress | None]:
        """Each progress report in turn, ``None`` when there is none yet (the
        I/O layer waits until :attr:`ready`); ends with the pull, raising its
        :class:`GenerationError` if it was refused or lost."""
        while self._unread or not self.finished:
            yield self.take()
        if self.error is not None:
            raise self.error

    def finished_done(self) -> PullDone:
        """The ``pull_done`` (call once :attr:`finished`); raises if there is none."""
        if self.done is None:
            raise self.error or GenerationError("internal", "the pull has not ended", self.id)
        return self.done

    def changed(self) -> None:
        """Called after a report arrived or the pull ended; a hook for I/O layers."""

    def deliver(self, frame: ServerFrame) -> None:
        if self.finished:
            return
        if isinstance(frame, Pulling):
            self.progress = frame.progress
            self._unread.append(frame.progress)
        elif isinstance(frame, PullDone):
            self.done = frame
        elif isinstance(frame, Error):
            self.error = GenerationError(frame.code, frame.message, frame.id)
        else:
            return
        self.changed()

    def fail(self, error: GenerationError) -> None:
        if not self.finished:
            self.error = error
            self.changed()


@dataclass(frozen=True, slots=True)
class Embedding:
    """An ``embed``'s result: each input's vector, in input order."""

    vectors: list[list[float]]
    model: str
    #: The tokens the server's engine read.
    prompt_tokens: int


class EmbedRequest:
    """One ``embed``: its one ``embed_done``, or the ``error`` that refused it."""

    def __init__(self, request_id: str, frame: dict[str, Any]) -> None:
        self.id = request_id
        self.frame = frame
        self.sent = False
        self.done: EmbedDone | None = None
        #: Why it ended without an ``embed_done`` (refused, connection lost).
        self.error: GenerationError | None = None

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def changed(self) -> None:
        """Called once it ended; a hook for I/O layers."""

    def deliver(self, frame: ServerFrame) -> None:
        if self.finished:
            return
        if isinstance(frame, EmbedDone):
            self.done = frame
        elif isinstance(frame, Error):
            self.error = GenerationError(frame.code, frame.message, frame.id)
        else:
            return
        self.changed()

    def fail(self, error: GenerationError) -> None:
        if not self.finished:
            self.error = error
            self.changed()

    def result(self) -> Embedding:
        """The vectors (call once :attr:`finished`); raises
        :class:`GenerationError` for a refused, failed or cancelled embed."""
        done = self.done
        if done is None:
            raise self.error or GenerationError("internal", "the embed has not ended", self.id)
        if done.reason == "cancelled":
            raise GenerationError("cancelled", "the embed was cancelled", self.id)
        if done.reason != "complete" or done.vectors is None:
            raise GenerationError(
                done.error_code or "internal", done.error_message or "embed failed", self.id
            )
        return Embedding(
            vectors=[floats_of(v) for v in done.vectors],
            model=done.model or "",
            prompt_tokens=done.prompt_tokens or 0,
        )


R = TypeVar("R", bound=Request)


class RequestTable(Generic[R]):
    """One connection's live requests, by ID, and the frames that drive them.

    ``policy`` is the reconnect/resume policy (the clients pass their
    ``reconnect_timeout`` as its ``timeout_s``); ``clock`` and ``draw`` are
    where the table reads the time and the jitter's draws, in [0, 1) (tests
    pass their own).
    """

    def __init__(
        self,
        policy: ReconnectPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy or ReconnectPolicy()
        self._clock = clock
        self._draw = draw
        self.live: dict[str, R] = {}
        #: Pulls not ended yet, by ID.
        self.pulls: dict[str, PullRequest] = {}
        #: Embeds not ended yet, by ID.
        self.embeds: dict[str, EmbedRequest] = {}
        self.hello: Hello | None = None
        #: ``error`` frames about no live request (for debugging and tests).
        self.errors: list[Error] = []
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()

    def new_id(self) -> str:
        return f"r{self._prefix}-{next(self._ids)}"

    def new_upload_id(self) -> str:
        """An upload's id (its own namespace on the server; distinct anyway)."""
        return f"img{self._prefix}-{next(self._ids)}"

    def hello_from(self, message: str | bytes) -> Hello:
        """The connection's first frame, which must be ``hello``."""
        first = parse_server_frame(message)
        if not isinstance(first, Hello):
            raise GenerationError("bad_request", f"expected hello, got {first!r}")
        self.hello = first
        return first

    # Frames to send. The I/O layer wraps the frame in its Request subclass
    # and registers it with add().

    def generate_frame(
        self,
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        request_id: str | None,
        params: dict[str, Any],
    ) -> tuple[str, dict[str, Any]]:
        request_id = request_id or self.new_id()
        frame: dict[str, Any] = {"type": "generate", "id": request_id, **params}
        if prompt is not None:
            frame["prompt"] = prompt
        if messages is not None:
            frame["messages"] = messages
        return request_id, frame

    def restart_frame(
        self, old: str | Request, new_id: str | None, overrides: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """Regenerate ``old``: the old request is abandoned at once (the server
        cancels it, if it still runs, on receiving the frame)."""
        old_id = old if isinstance(old, str) else old.id
        previous = self.live.get(old_id)
        if previous is not None:
            previous.abandon()
        request_id = new_id or self.new_id()
        return request_id, {"type": "restart", "id": old_id, "new_id": request_id, **overrides}

    def cancel_frame(self, request_id: str) -> tuple[R | None, dict[str, Any]]:
        """Abandon ``request_id`` (if live) and the frame that cancels it."""
        request = self.live.get(request_id)
        frame: dict[str, Any] = {"type": "cancel", "id": request_id}
        if request is not None:
            request.abandon()
            if request.resume_token is not None:
                # Works whether this connection holds it or it is detached.
                frame["resume_token"] = request.resume_token
        return request, frame

    def add(self, request: R) -> R:
        self.live[request.id] = request
        return request

    def pull_frame(self, reference: str, request_id: str | None) -> tuple[str, dict[str, Any]]:
        request_id = request_id or self.new_id()
        return request_id, {"type": "pull", "id": request_id, "model": reference}

    def add_pull(self, pull: PullRequest) -> PullRequest:
        self.pulls[pull.id] = pull
        return pull

    def embed_frame(
        self, input: Any, model: str | None, request_id: str | None
    ) -> tuple[str, dict[str, Any]]:
        """An ``embed`` frame (its vectors asked for as base64: compact)."""
        request_id = request_id or self.new_id()
        frame: dict[str, Any] = {
            "type": "embed",
            "id": request_id,
            "input": input,
            "encoding_format": "base64",
        }
        if model is not None:
            frame["model"] = model
        return request_id, frame

    def add_embed(self, embed: EmbedRequest) -> EmbedRequest:
        self.embeds[embed.id] = embed
        return embed

    # Frames received.

    def receive(self, message: str | bytes) -> R | None:
        """Route one received message; returns the request it was about, if live."""
        frame = parse_server_frame(message)
        request_id = getattr(frame, "id", None)
        embed = self.embeds.get(request_id) if request_id is not None else None
        if embed is not None:
            embed.deliver(frame)
            if embed.finished:
                del self.embeds[embed.id]
            return None
        pull = self.pulls.get(request_id) if request_id is not None else None
        if pull is not None:
            pull.deliver(frame)
            if pull.finished:
                del self.pulls[pull.id]
            return None
        request = self.live.get(request_id) if request_id is not None else None
        if request is None:
            # Late frames of finished requests are dropped; errors kept for debugging.
            if isinstance(frame, Error):
                self.errors.append(frame)
            return None
        request.deliver(frame)
        if request.finished:
            del self.live[request.id]
        return request

    # The way back after a lost connection (wsserver_client.reconnect).

    def lost(self, reason: str, *, keep_resumable: bool = False) -> list[R]:
        """The connection closed: every live request fails with
        ``connection_lost`` — but with ``keep_resumable`` (the client will
        reconnect), resumable ones stay live (returned) for :meth:`resume_frames`
        after a reconnect."""
        now = self._clock()
        for embed in list(self.embeds.values()):
            if embed.sent:  # not resumed: the server cancels it with the connection
                embed.fail(GenerationError("connection_lost", reason, embed.id))
                del self.embeds[embed.id]
        for pull in list(self.pulls.values()):
            if pull.sent:  # not resumed: the server leaves a download nobody waits for
                pull.fail(GenerationError("connection_lost", reason, pull.id))
                del self.pulls[pull.id]
        kept = []
        for request in list(self.live.values()):
            request.resuming = False
            if keeps_on_loss(request.resumable, reconnecting=keep_resumable):
                if not request.suspended:  # still away since an earlier loss: that one counts
                    request.lost_at = now
                request.suspended = True
                kept.append(request)
                continue
            request.fail(GenerationError("connection_lost", reason, request.id))
            del self.live[request.id]
        return kept

    def reconnect_waits(self) -> Iterator[float]:
        """The wait before each try to reconnect, for as long as a request is
        kept. Before each wait, a kept request that the try would reach later
        than the policy allows fails with ``connection_lost`` and leaves the
        table; the waits end when none is left."""
        for attempt in itertools.count(1):
            draw, now = self._draw(), self._clock()
            for request in self._suspended():
                if self.policy.wait(attempt, now - request.lost_at, draw) is None:
                    self._give_up(request, RECONNECT_GAVE_UP, "could not reconnect in time")
            if not self._suspended():
                return
            yield self.policy.delay(attempt, draw)

    def resume_frames(self) -> list[dict[str, Any]]:
        """After a reconnect: a frame for each request kept by :meth:`lost`."""
        return [self.resume_frame(r) for r in self._suspended()]

    def resume_frame(self, request: Request) -> dict[str, Any]:
        """``resume`` a kept request — or ``cancel`` it with its token if the
        caller abandoned it meanwhile (:func:`~wsserver_client.reconnect.resume_frame`)."""
        assert request.resume_token is not None
        request.retry_resume = False
        if not request.abandoned:
            request.resuming = True
            request.resume_attempts += 1
        return resume_frame(
            request.id, request.resume_token, request.last_seq, abandoned=request.abandoned
        )

    def retry_wait(self, request: R) -> float | None:
        """The server refused ``request``'s resume as ``already_attached``
        (:attr:`Request.retry_resume`): the wait before asking again — or
        ``None`` when the policy's time is up: the request then failed with
        ``already_attached`` and left the table."""
        elapsed = self._clock() - request.lost_at
        wait = self.policy.wait(request.resume_attempts, elapsed, self._draw())
        if wait is None:
            self._give_up(request, RESUME_GAVE_UP, "resume kept being refused")
        return wait

    def _suspended(self) -> list[R]:
        return [r for r in self.live.values() if r.suspended]

    def _give_up(self, request: R, code: str, message: str) -> None:
        request.fail(GenerationError(code, message, request.id))
        self.live.pop(request.id, None)

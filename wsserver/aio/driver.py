"""The request driver: a request's way through the server, written once.

Theory of operation
-------------------
Every wire — the WebSocket protocol (:mod:`wsserver.aio.connection`), every
HTTP API (through the HTTP exchange, :mod:`wsserver.aio.exchange`) — is a
*dialect*: it parses its bytes into the core's client frames and hands them to a
:class:`RequestDriver`, and it renders the frames the driver gives back
(:class:`Dialect`). Everything between is the driver's, the same for every
wire:

* the model a request asks for, resolved once — here, or on its way in by
  the HTTP exchange — and handed to its generation;
* the :class:`~wsserver.core.session.Session`, fed through its one entry with the
  client's frames and with the reports (:mod:`wsserver.core.events`) of each
  request's :class:`~wsserver.aio.pipeline.Generation` (admission, the
  scheduler, the engine, the pump);
* :meth:`RequestDriver.apply`, the one way out of the session: frames to the
  dialect, and with every ``error`` and ``done`` its metrics and its log line;
  generations started and stopped;
* cancel, restart, resume (adopting a parked request, cancelling a detached
  one, parking on a lost connection), the stall of a client that reads
  nothing while others wait, background sends, and the teardown.

So a request goes down once — dialect → driver → session — and its answers
come back up once — session → driver → dialect; a generation's reports take
the same way in (generation → driver → session → driver → dialect).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from ..core.events import (
    DoneDelivered,
    Finished,
    ModelGranted,
    Outcome,
    ProducerExited,
    PromptCounted,
    QueuePosition,
    Report,
    TextProduced,
)
from ..core.protocol import (
    Cancel,
    ClientFrame,
    Delta,
    Done,
    Error,
    Generate,
    Progress,
    Restart,
    Resume,
    ServerFrame,
)
from ..core.session import (
    Effect,
    RequestState,
    Send,
    Session,
    StartGeneration,
    StopGeneration,
    input_size,
)
from ..errors import ProtocolError, WireLost
from ..logs import ConnectionLog
from .models import Model
from .pipeline import Generation
from .request_log import log_done
from .resume import Resumes
from .services import Services

__all__ = ["Dialect", "RequestDriver"]

_LIVE: Final = (RequestState.WAITING, RequestState.RUNNING)

#: Inputs up to this size (``session.input_size``) are checked on the loop:
#: a millisecond at most, less than a thread's hand-over would cost.
CHECK_INLINE_BYTES: Final = 4096


class Dialect(Protocol):
    """How one wire writes the core's frames."""

    async def write(self, frame: ServerFrame) -> None:
        """Render one frame. Raises :class:`~wsserver.errors.WireLost` when the
        wire is lost and could tell (a WebSocket); a wire that cannot (HTTP)
        drops it."""


class _Closed:
    """The dialect of a driver whose connection is gone."""

    async def write(self, frame: ServerFrame) -> None:
        raise WireLost("the connection is gone")


class RequestDriver:
    """Drives the requests of one session: a WebSocket connection's, or one HTTP request's."""

    def __init__(
        self,
        services: Services,
        *,
        dialect: Dialect,
        log: ConnectionLog,
        session: Session,
        resumes: Resumes | None = None,
        generations: dict[str, Generation] | None = None,
        on_gone: Callable[[Generation], None] | None = None,
        client: str | None = None,
        on_prompt: Callable[[PromptCounted], None] | None = None,
    ) -> None:
        self.services = services
        #: The client's address, for the caps on detached requests.
        self.client = client
        self.log = log
        self.session = session
        #: Generations started here whose engine is not gone yet (a table the
        #: connection may share among the drivers of its requests).
        self.generations: dict[str, Generation] = {} if generations is None else generations
        #: Set when the connection is going: nothing starts, nothing more is reported.
        self.closed = False
        self._dialect: Dialect = dialect
        self._resumes = resumes
        self._resumable_default = services.config.stream.resumable
        self._on_gone = on_gone
        #: Told the prompt's count as the engine reports it (a dialect that
        #: writes it before the end: the Messages API's ``message_start``).
        self._on_prompt = on_prompt
        #: The request the session accepted last and its model, until its generation starts.
        self._accepted: tuple[str, Model] | None = None
        self._loop = asyncio.get_running_loop()

    # ------------------------------------------------------------ the client's side

    async def receive(self, frame: ClientFrame, *, model: Model | None = None) -> None:
        """A client frame, parsed by the dialect. ``model``: a ``generate``'s,
        already resolved on its way in (an HTTP exchange's); else it is
        resolved here — once: the request's generation is given it."""
        now = self._loop.time()
        if isinstance(frame, Generate | Restart):
            # The engine refuses what it cannot serve as asked (a grammar that
            # does not compile, a prompt beyond the context) before anything
            # starts. For a long input that check renders a template and counts
            # tokens (~30 ms for 100,000 characters), and an engine may say it
            # waits on something slow (a chat template's render in a worker
            # process, up to its time bound): off the loop, which would
            # otherwise hold up every other stream meanwhile.
            asked = (
                frame if isinstance(frame, Generate) else Generate(frame.new_id, **frame.overrides)
            )
            try:
                if model is None:
                    model, frame, asked = self._resolve(frame, asked)
                check = model.backend.check
                # A schema (or the tools' schemas) may convert to a grammar
                # hundreds of times its size, which the engine's bounds then
                # parse (grammar_bounds): never on the loop.
                constrained = asked.json_schema is not None or asked.tools is not None
                if (
                    constrained
                    or input_size(asked) > CHECK_INLINE_BYTES
                    or model.backend.check_blocks(asked)
                ):
                    await asyncio.to_thread(check, asked)
                else:
                    check(asked)
            except ProtocolError as exc:
                await self.refuse(exc)
                return
            fresh = self.session.state_of(asked.id) is None
            effects = self.session.handle(frame, now)
            if fresh and self.session.active_id == asked.id:
                # Accepted: its generation starts with this model (now, or
                # once the previous request's engine is gone).
                self._accepted = (asked.id, model)
            await self.apply(effects)
        elif isinstance(frame, Resume):
            await self._resume(frame, now)
        elif (
            isinstance(frame, Cancel)
            and frame.resume_token is not None
            and self.session.state_of(frame.id) not in _LIVE
        ):
            await self._cancel_detached(frame, frame.resume_token, now)
        else:
            await self.apply(self.session.handle(frame, now))

    def _resolve(
        self, frame: Generate | Restart, asked: Generate
    ) -> tuple[Model, Generate | Restart, Generate]:
        """The model a request asks for, and the request carrying the name it
        is served under (an alias's canonical name: ``done`` says it). An
        unknown model is refused here, before anything is queued."""
        models = self.services.models
        if isinstance(frame, Restart) and "model" not in frame.overrides:
            return models.resolve(self._restarted_model(frame), asked.id), frame, asked
        model, name = models.lookup(asked.model, asked.id)
        asked = dataclasses.replace(asked, model=name)
        if isinstance(frame, Generate):
            return model, asked, asked
        overrides = {**frame.overrides, "model": name}
        return model, dataclasses.replace(frame, overrides=overrides), asked

    def _restarted_model(self, frame: Restart) -> str | None:
        """The model of the request a ``restart`` runs again (unless it names one)."""
        kept = self.session.kept_input(frame.id)
        return kept.model if kept is not None else None

    async def refuse(self, exc: ProtocolError) -> None:
        """A frame the dialect could not parse, or refused: its ``error``."""
        await self.apply(self.session.refuse(exc))

    def cancel_soon(self, why: str | None = None) -> None:
        """From a callback (an HTTP client gone, the server's shutdown): end
        the running request as cancelled; its ``done`` is written in the background."""
        request_id = self.session.active_id
        if request_id is None:
            return
        if why is not None:
            self.log.request(request_id).info(why)
        self.services.in_background(self.cancel_active())

    async def cancel_active(self) -> None:
        """End the running request as cancelled (the client left, or the server
        stops), and write its ``done``."""
        request_id = self.session.active_id
        if request_id is not None:
            effects = self.session.handle(Cancel(id=request_id), self._loop.time())
            await self._apply_safely(effects)

    # ------------------------------------------------------------ the generations' side

    async def report(self, event: Report) -> bool:
        """What happened to a request: ask the session, write its answer.
        Whether the request is still live afterwards."""
        now = self._loop.time()
        if isinstance(event, ModelGranted):
            return await self._granted(event, now)
        effects = self.session.handle(event, now)
        if isinstance(event, TextProduced) and effects:
            self._log_first_text(event.id, effects, now)
        await self.apply(effects)
        return self.session.state_of(event.id) in _LIVE

    def note(self, event: Report) -> None:
        """A report that sends nothing (the prompt count)."""
        effects = self.session.handle(event, self._loop.time())
        assert not effects, effects
        if self._on_prompt is not None and isinstance(event, PromptCounted):
            self._on_prompt(event)

    def queued(
        self,
        request_id: str,
        position: int,
        loading: bool = False,
        download: Progress | None = None,
    ) -> None:
        """The scheduler's callback: a waiting request's position changed
        (``loading``: its model is still being loaded; ``download``: and
        before that downloaded, this far)."""
        effects = self.session.handle(
            QueuePosition(request_id, position, loading, download), self._loop.time()
        )
        if effects:
            self.services.in_background(self._send_queued(request_id, effects))

    async def _send_queued(self, request_id: str, effects: list[Effect]) -> None:
        # This runs as a task, after the scheduler's callback: meanwhile a cancel
        # may have ended the request and sent its done. Check at the last moment
        # (no await between the check and the write) so that a queued frame
        # never follows its done.
        if self.session.state_of(request_id) is RequestState.WAITING:
            await self._apply_safely(effects)

    async def _granted(self, event: ModelGranted, now: float) -> bool:
        generation = self.generations.get(event.id)
        # >= 128 bits: the request id alone is not a credential.
        resumable = generation is not None and generation.resumable
        token = secrets.token_urlsafe(24) if resumable else None
        effects = self.session.handle(ModelGranted(event.id, token), now)
        if not effects or generation is None:
            return False
        if token is not None and self._resumes is not None:
            self._resumes.add(generation)
        queued_ms = (now - generation.record.received) * 1000.0
        generation.log.info(
            "started model=%s slot=%s queued=%.1fms",
            generation.model.name,
            generation.slot,
            queued_ms,
            extra={
                "model": generation.model.name,
                "slot": generation.slot,
                "queued_ms": round(queued_ms, 3),
            },
        )
        await self.apply(effects)
        return True

    def _log_first_text(self, request_id: str, effects: list[Effect], now: float) -> None:
        first = effects[0]
        if isinstance(first, Send) and isinstance(first.frame, Delta) and first.frame.seq == 0:
            record = self.session.record(request_id)
            ttft_ms = 0.0 if record is None else (now - record.received) * 1000.0
            self.log.request(request_id).info(
                "first text ttft=%.1fms", ttft_ms, extra={"ttft_ms": round(ttft_ms, 3)}
            )

    async def generation_gone(self, generation: Generation) -> None:
        """A generation's task has ended and its engine is gone."""
        request_id = generation.request.id
        if self._resumes is not None and generation.resume_token is not None:
            self._resumes.discard(generation)
        if self.generations.get(request_id) is generation:
            del self.generations[request_id]
        if self._on_gone is not None:
            self._on_gone(generation)
        if not self.closed:
            effects = self.session.handle(ProducerExited(request_id), self._loop.time())
            await self._apply_safely(effects)

    def stall(self, *, every: bool = False) -> None:
        """The client read nothing for the stall timeout: end the requests whose
        engine waits on it, if another request waits for the model (else
        nobody is harmed). ``every``: end all of this driver's live requests,
        waiting for the model or running, blocked or not — the caller judged
        that others wait (a connection whose lanes count together)."""
        if not every and self.services.models.waiting == 0:
            return
        now = self._loop.time()
        for generation in list(self.generations.values()):
            if generation.stopped or self.session.state_of(generation.request.id) not in _LIVE:
                continue  # (the table may be shared with other drivers: theirs)
            if every or generation.channel.blocked.is_set():
                generation.log.warning(
                    "client read nothing for %.1fs; ending the request as stalled",
                    self.services.config.stream.stall_timeout_s,
                )
                stalled = Outcome(
                    reason="error",
                    completion_tokens=generation.channel.tokens,
                    error_code="stalled",
                    error_message="the client read nothing for the stall timeout",
                )
                effects = self.session.handle(Finished(generation.request.id, stalled), now)
                generation.stop()
                if effects:
                    # Logged (and counted) when written, like every done.
                    self.services.in_background(self._apply_safely(effects))

    # ------------------------------------------------------------ the one way out

    async def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out the session's effects, in order: the one way out of the session."""
        for effect in effects:
            if isinstance(effect, Send):
                frame = effect.frame
                if isinstance(frame, Error):
                    self.services.metrics.errors.labels(frame.code).inc()
                    self.log.request(frame.id).info(
                        "refused: %s %s", frame.code, frame.message, extra={"code": frame.code}
                    )
                elif isinstance(frame, Done):
                    self.services.metrics.done(frame)
                    log_done(self.log.request(frame.id), frame)
                await self._dialect.write(frame)
                if isinstance(frame, Done):
                    self.session.handle(DoneDelivered(frame.id), self._loop.time())
            elif isinstance(effect, StartGeneration):
                self._start(effect)
            elif isinstance(effect, StopGeneration):
                generation = self.generations.get(effect.id)
                if generation is not None:
                    generation.log.info("cancel")
                    generation.cancel_at(self._loop.time())

    def _start(self, effect: StartGeneration) -> None:
        request = effect.request
        record = self.session.record(request.id)
        accepted, self._accepted = self._accepted, None
        if self.closed or record is None:
            return  # closed: nothing starts any more
        assert accepted is not None and accepted[0] == request.id, (accepted, request.id)
        wants = request.resumable if request.resumable is not None else self._resumable_default
        generation = Generation(
            request, self, record, model=accepted[1], resumable=wants and self._resumes is not None
        )
        self.generations[request.id] = generation
        generation.task = asyncio.create_task(
            generation.run(), name=f"generation-{self.log.conn_id}-{request.id}"
        )

    async def _apply_safely(self, effects: Iterable[Effect]) -> None:
        with contextlib.suppress(WireLost):
            await self.apply(effects)

    # ------------------------------------------------------------ resuming

    async def _resume(self, frame: Resume, now: float) -> None:
        """Adopt a detached request: ``resumed``, the replay, then live frames."""
        resumes = self._resumes
        try:
            if resumes is None or self.closed:
                raise ProtocolError("unknown_id", f"no resumable request {frame.id!r}", frame.id)
            record = resumes.claim(frame.id, frame.resume_token)
            assert record.parked is not None
            effects = self.session.adopt(record.parked, frame.after_seq, now)
        except ProtocolError as exc:
            await self.refuse(exc)
            return
        parked = resumes.take(record)
        generation = record.generation
        generation.log.info(
            "resumed on %s after seq %d (%d replayed)",
            self.log.conn_id,
            frame.after_seq,
            parked.next_seq - 1 - frame.after_seq,
            extra={"after_seq": frame.after_seq},
        )
        if not parked.finished:
            self.generations[frame.id] = generation
        try:
            await self.apply(effects)
        finally:
            # After the replay (or if this connection broke during it: then
            # its teardown parks the request again, and the tail still holds
            # the frames).
            generation.attach(self)

    async def _cancel_detached(self, frame: Cancel, token: str, now: float) -> None:
        """``cancel`` with a token for a request detached from its connection."""
        resumes = self._resumes
        try:
            if resumes is None:
                raise ProtocolError("unknown_id", f"no running request {frame.id!r}", frame.id)
            record = resumes.claim(frame.id, token)
        except ProtocolError as exc:
            await self.refuse(exc)
            return
        assert record.parked is not None
        done = record.parked.cancelled_done(now)
        record.generation.log.info("cancel (detached, from %s)", self.log.conn_id)
        resumes.drop(record, now)
        await self.apply([Send(done)])

    def _park(self, generation: Generation) -> bool:
        """The connection is lost: keep a resumable request for a resume."""
        resumes = self._resumes
        if resumes is None or resumes.closing or generation.stopped:
            return False
        if generation.resume_token is None:
            return False
        parked = self.session.detach(generation.request.id)
        if parked is None or (parked.finished and not generation.waiting_for_resume):
            return False
        generation.detach()
        if not resumes.park(generation, parked, self.client):
            return False
        self.generations.pop(generation.request.id, None)
        generation.log.info(
            "connection lost; detached, waiting %.1fs for a resume at seq %d",
            resumes.grace_s,
            parked.next_seq,
        )
        return True

    # ------------------------------------------------------------ closing

    def peer_closing(self) -> None:
        """The client is going: stop producing for it right away (a resumable
        request is parked at :meth:`close` instead)."""
        self.closed = True
        for generation in list(self.generations.values()):
            if generation.resume_token is None:
                generation.stop()

    async def close(self) -> None:
        """The connection is gone: park what can be resumed, stop the rest and
        wait for their engines."""
        self.closed = True
        self._dialect = _Closed()
        stopping = [g for g in list(self.generations.values()) if not self._park(g)]
        for generation in stopping:
            generation.stop()
        tasks = [g.task for g in stopping if g.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def buffered_bytes(self) -> int:
        """Bytes this driver's requests hold in their channels."""
        return sum(g.channel.buffered_bytes() for g in list(self.generations.values()))

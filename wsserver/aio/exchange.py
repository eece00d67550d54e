"""One HTTP exchange: a request of any HTTP dialect, from its parsed body to its answer's end.

Theory of operation
-------------------
Every HTTP dialect — OpenAI's chat completions and completions
(:mod:`wsserver.aio.openai_routes`), the Responses API
(:mod:`wsserver.aio.responses_http`), Anthropic's Messages API
(:mod:`wsserver.aio.anthropic_http`), Ollama's API
(:mod:`wsserver.aio.ollama_http`) — parses its body into the core's
:class:`~wsserver.core.protocol.Generate` and hands it here with its
:class:`~wsserver.dialects.exchange.Renderer`: the dialect's sans-I/O half, which
turns the core's frames into its bytes. Everything else is the exchange's,
written once for every dialect:

* **the model**, resolved once on the request's way in (:func:`resolve`:
  the name asked for, an alias, the default; ``model_not_found`` is a 404 in
  the dialect's shape) and carried to the engine: the driver and the
  pipeline do not look it up again;
* **the request driver** (:class:`~wsserver.aio.driver.RequestDriver`) with a
  :class:`~wsserver.core.session.Session` of its own: the scheduler's queue, the
  engine, the bounded channel, the pacing, cancel — as a WebSocket
  ``generate`` runs; the exchange is the driver's dialect (:meth:`Exchange.write`);
* **the answer** (:class:`~wsserver.aio.http_answer.HttpAnswer`): streamed,
  its head when the request waits (then the dialect's keep-alive) or starts,
  a chunk per ``delta`` — each write waits while the transport is above its
  high-water mark, so a slow reader pauses its own engine —; whole, the text
  gathered by the renderer. How it ends — the stream's last events, the whole
  body, an error in the stream or as the whole answer, and with which status —
  is one table for every dialect, :data:`wsserver.dialects.exchange.ENDINGS`;
* **client gone, cancel, stall**: a disconnect is a cancel (its engine stops
  within a step, mid-prompt too); the server's shutdown cancels and the
  client is told (503, :data:`~wsserver.dialects.exchange.SHUTTING_DOWN`) — even when
  it comes while the engine still checks the request; a client that reads
  nothing while others wait for the model ends as ``stalled``.

Adding a dialect is a renderer and a route registered in
:func:`wsserver.aio.http_router.api_routes`, nothing else.

**Embeddings and rerank** (:meth:`Exchange.run_embed`) take the same way
in — the model resolved once, a disconnect a cancel, the shutdown a 503 —
but are no generation: no driver, no session, nothing streamed. Their engine
side is :class:`~wsserver.aio.embed_run.EmbedRun` (the model's scheduler, the
engine's step), and the answer one whole body, or the refusal the router
writes in OpenAI's shape (``context_length_exceeded`` a 400 naming the input).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

from ..core.embedding import Embed, Embedded
from ..core.events import PromptCounted
from ..core.protocol import Delta, Done, Error, Generate, Queued, ServerFrame, Started
from ..core.session import Session
from ..dialects.api_errors import ApiError
from ..dialects.exchange import SHUTTING_DOWN, Renderer, ending
from ..errors import CONTEXT_LENGTH_EXCEEDED, ProtocolError
from .choices import ChoiceMerge, check_choices, choice_frames
from .driver import RequestDriver
from .embed_run import EmbedRun
from .http_answer import HttpAnswer
from .http_route import RouteRequest
from .image_fetch import fetched_generate
from .models import Model
from .services import Services

__all__ = ["CLIENT_GONE", "Exchange", "resolve"]

#: The log line of an HTTP request whose client went away while it ran.
CLIENT_GONE: Final = "client disconnected; cancelling"


def resolve(services: Services, generate: Generate, asked: str | None) -> tuple[Generate, Model]:
    """The model ``asked`` for (``None``: the default; an alias; a name an
    engine serves) and the request carrying the name it is served under, which
    the answer names: resolved here, once per request. ``model_not_found`` is
    a 404 in the dialect's shape."""
    try:
        return services.models.for_api(generate, asked)
    except ProtocolError as exc:
        raise ApiError.from_protocol(exc) from None


class Exchange:
    """One HTTP request on the request driver, whatever its dialect."""

    def __init__(self, route: RouteRequest, services: Services) -> None:
        self._route = route
        self._services = services
        self._renderer = Renderer()
        self._answer: HttpAnswer | None = None
        #: The request's driver; one per choice of a request for several.
        self._drivers: list[RequestDriver] = []
        #: The server's shutdown came before the driver had the request.
        self._cancelled = False
        #: An embedding request's engine side (:meth:`run_embed`).
        self._embedding: EmbedRun | None = None

    async def run(
        self,
        generate: Generate,
        asked: str | None,
        renderer_for: Callable[[str], Renderer],
        *,
        model: Model | None = None,
    ) -> None:
        """Serve the request on the model ``asked`` for (:func:`resolve`), its
        answer rendered by the renderer made for the name it is served under; returns
        once the answer is complete, or its client is gone (which is a cancel).
        ``model``: resolved already by a dialect that names models its own way
        (Ollama's ``:latest``), ``generate.model`` the name it is served under."""
        if model is None:
            generate, model = resolve(self._services, generate, asked)
        # Image URLs fetched (or refused) before the request is submitted.
        fetched = await fetched_generate(self._route, self._services.config.images, generate, model)
        if fetched is None:
            return  # the client went while they were fetched
        generate = fetched
        # The name it is served under: an alias's model's, or (an engine that
        # picks among its upstreams' models) the name asked for.
        assert generate.model is not None
        self._renderer = renderer = renderer_for(generate.model)
        route = self._route
        answer = self._answer = HttpAnswer(
            route.out, route.headers, keepalive=renderer.keepalive, media_type=renderer.media_type
        )
        frames = [generate]
        merge = None
        if generate.n > 1:  # several choices: a driver each (wsserver.aio.choices)
            check_choices(generate.n, model.backend.slots)
            frames = choice_frames(generate)
            merge = ChoiceMerge(generate.n, write=self.write, finish=self._choice_done)
        drivers = self._drivers = [
            RequestDriver(
                self._services,
                dialect=self if merge is None else merge.dialect(frame.choice),
                log=route.log,
                session=Session(restart_bytes=0),
                generations=route.generations,
                on_gone=route.on_gone,
                on_prompt=self._prompt_counted if frame.choice == 0 else None,
            )
            for frame in frames
        ]
        if merge is not None:
            merge.drivers = drivers
        route.begin(self)
        try:
            for driver, frame in zip(drivers, frames, strict=True):
                await driver.receive(frame, model=model)
                if merge is not None and merge.over:
                    merge.cancel_all()  # a choice failed: the rest would run for nobody
                    break
            for driver in drivers:
                if route.out.lost:
                    driver.cancel_soon(CLIENT_GONE)  # went while the request was being set up
                elif self._cancelled:
                    await driver.cancel_active()  # the shutdown came meanwhile
            await answer.finished
        finally:
            answer.stop_keepalive()

    async def run_embed(
        self,
        request: Embed,
        asked: str | None,
        render: Callable[[Embedded, str], bytes],
        *,
        model: Model | None = None,
    ) -> None:
        """Serve an embedding or rerank request on the model ``asked`` for; its
        answer is ``render(result, served name)``, whole. Returns once it is
        answered, or its client is gone (which cancels it in the engine).
        ``model``: resolved already by a dialect that names models its own
        way (Ollama's), ``asked`` the name it is served under."""
        route = self._route
        if model is not None and asked is not None:
            name = asked
        else:
            try:
                model, name = self._services.models.lookup(asked, request.id)
            except ProtocolError as exc:
                raise ApiError.from_protocol(exc) from None
        request = dataclasses.replace(request, model=name, conn_id=route.log.conn_id)
        run = self._embedding = EmbedRun(self._services, model, request)
        route.begin(self)
        if self._cancelled or route.out.lost:
            run.cancel()
        try:
            result = await run.run()
        except ProtocolError as exc:
            if exc.detail == CONTEXT_LENGTH_EXCEEDED:
                raise ApiError(
                    HTTPStatus.BAD_REQUEST, exc.message, CONTEXT_LENGTH_EXCEEDED, "input"
                ) from None
            raise ApiError.from_protocol(exc) from None
        if result is None:
            if route.out.lost:
                route.log.request(request.id).info(CLIENT_GONE)
                return
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, SHUTTING_DOWN, "cancelled")
        route.log.request(request.id).info(
            "%s: %d input(s), %d token(s)",
            request.kind,
            len(request.inputs),
            result.prompt_tokens,
        )
        # Rendered off the loop: 2,048 vectors of 640 floats are ~0.1-0.15 s
        # of Python (floats, Ollama's normalising), the other streams' pacing.
        body = await asyncio.to_thread(render, result, name)
        route.out.simple(HTTPStatus.OK, body, route.headers)

    # ------------------------------------------------------------ the connection's calls

    def client_gone(self) -> None:
        """The client disconnected: that is a cancel (of every choice)."""
        for driver in self._drivers:
            driver.cancel_soon(CLIENT_GONE)
        if self._embedding is not None:
            self._embedding.cancel()

    def cancel(self) -> None:
        """Server shutdown: end the request as cancelled (the client is told)."""
        self._cancelled = True
        for driver in self._drivers:
            driver.cancel_soon()
        if self._embedding is not None:
            self._embedding.cancel()

    def stall(self) -> None:
        """The client read nothing for the stall timeout (see the driver's rule)."""
        for driver in self._drivers:
            driver.stall()

    # ------------------------------------------------------------ the driver's dialect

    async def write(self, frame: ServerFrame) -> None:
        """Render one frame of the request: a chunk, the head, the end."""
        renderer = self._renderer
        answer = self._answer
        assert answer is not None
        if isinstance(frame, Delta):
            if renderer.stream:
                answer.head()
                data = renderer.chunk(frame)
                if data:  # b"": nothing yet (a call a dialect sends whole)
                    await answer.write(data)
            else:
                renderer.gather(frame)
        elif isinstance(frame, Started):
            # The head now: a client's stream returns while the prompt is read.
            if renderer.stream:
                answer.head()
                started = renderer.started()
                if started:
                    await answer.write(started)
        elif isinstance(frame, Queued):
            if renderer.stream:
                answer.head()
                if renderer.keepalive:
                    await answer.write(renderer.keepalive, progress=False)
        elif isinstance(frame, Done | Error):
            end = ending(renderer, frame, head_sent=answer.head_sent)
            if end.in_stream:
                answer.head()
                answer.write_last(end.data)
            else:
                answer.respond(end.status, end.data)

    async def _choice_done(self, done: Done, index: int) -> None:
        """One of several choices ran to its end: its finish chunk, if streamed."""
        data = self._renderer.choice_done(done, index)
        if data and self._answer is not None:
            self._answer.head()
            await self._answer.write(data)

    def _prompt_counted(self, event: PromptCounted) -> None:
        self._renderer.prompt_counted(event.prompt_tokens, event.cached_tokens)

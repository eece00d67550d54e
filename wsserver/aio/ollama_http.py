"""Ollama's API over HTTP: ``/api/…`` on the HTTP/1.1 transport.

:class:`OllamaRoute` is the route :mod:`wsserver.aio.openai_http` hands
``/api`` and everything under it (the seam of :mod:`wsserver.aio.http_route`;
the gate's checks have run, the token taken as a Bearer, which Ollama's
clients send from ``OLLAMA_API_KEY``):

* ``POST /api/chat`` and ``POST /api/generate`` — the body parsed
  (:mod:`wsserver.dialects.ollama.api`), its model named the registry's way
  (:func:`served_name`), ``options.num_ctx`` checked against the model, and
  run on the HTTP exchange (:mod:`wsserver.aio.exchange`) with Ollama's
  renderer (:class:`~wsserver.dialects.ollama.render.OllamaAnswer`), as every
  request runs: the shared queue, paced objects, bounded memory behind a slow
  reader, a disconnect that cancels — even mid-prompt. A request with nothing
  to answer loads the model (or with ``keep_alive`` 0 unloads it) and says so
  in one object (``done_reason`` ``load``, ``unload``).

Every refusal and failure is Ollama's ``{"error": "…"}``
(:func:`wsserver.dialects.ollama.api.error_body`; the transport uses it for
this path's refusals too, the gate's 401 included): before the head, as the
response with its status; after it, as the stream's last line.
"""

from __future__ import annotations

from dataclasses import replace
from http import HTTPStatus
from typing import Final

from ..dialects.api_errors import ApiError, parse_json
from ..dialects.ollama.api import Kind, OllamaRequest, parse_chat, parse_generate
from ..dialects.ollama.options import check_num_ctx
from ..dialects.ollama.render import OllamaAnswer, loaded_object
from ..errors import ProtocolError
from .exchange import Exchange
from .http_answer import HttpAnswer
from .http_route import RouteRequest, clip, no_route, not_allowed
from .models import Model, ModelPool
from .services import Services

__all__ = ["PREFIX", "OllamaRoute", "served_name"]

PREFIX: Final = "/api"
#: The tag Ollama gives a name that has none.
LATEST: Final = ":latest"


def served_name(models: ModelPool, name: str, request_id: str | None = None) -> tuple[str, Model]:
    """The model an Ollama client names and the name it is served under
    (:meth:`~wsserver.aio.models.ModelPool.lookup`, once per request): the
    name itself (a model's name or an alias — ``gemma3:270m`` can be one),
    else the name without its ``:latest`` tag (Ollama's clients add it);
    unknown, Ollama's 404 ``model '…' not found``."""
    registry = name
    if name.endswith(LATEST) and not models.knows(name):
        registry = name.removesuffix(LATEST)
    try:
        model, served = models.lookup(registry, request_id)
    except ProtocolError:
        pass
    else:
        return served, model
    listed = ", ".join(repr(n) for n in models.names()[:20])
    raise ApiError(
        HTTPStatus.NOT_FOUND,
        f"model {clip(name)!r} not found; the models here are: {listed}",
        "model_not_found",
    )


class OllamaRoute:
    """``/api/…``; built once by the server."""

    def __init__(self, services: Services) -> None:
        self._services = services

    async def __call__(self, request: RouteRequest) -> None:
        path, method = request.path, request.method
        if path in ("/api/chat", "/api/generate"):
            if method != "POST":
                raise not_allowed(method, "POST")
            await self._generate(request, "chat" if path == "/api/chat" else "generate")
            return
        raise no_route(method, path)

    async def _generate(self, route: RouteRequest, kind: Kind) -> None:
        services = self._services
        obj = parse_json(route.body)
        parse = parse_chat if kind == "chat" else parse_generate
        ollama = parse(obj, route.request_id, services.wire_limits)
        served, model = served_name(services.models, ollama.model, route.request_id)
        bound = check_num_ctx(ollama.num_ctx, ollama.model, model.info().n_ctx)
        generate = ollama.generate
        if generate is None:
            await self._load(route, ollama, model)
            return
        generate = replace(generate, model=served)
        if bound is not None and (generate.max_tokens is None or generate.max_tokens > bound):
            generate = replace(generate, max_tokens=bound)

        def answer(_: str) -> OllamaAnswer:
            # Ollama echoes the name the client gave.
            return OllamaAnswer(
                ollama.kind, ollama.model, stream=ollama.stream, logprobs=ollama.logprobs
            )

        await Exchange(route, services).run(generate, served, answer, model=model)

    async def _load(self, route: RouteRequest, ollama: OllamaRequest, model: Model) -> None:
        """Nothing to answer: load the model, or unload it (``keep_alive`` 0)."""
        models = self._services.models
        if ollama.keep_alive == 0:
            models.expire(model)
            reason = "unload"
        else:
            try:
                await models.warm(model, route.request_id, ollama.keep_alive)
            except ProtocolError as exc:
                raise ApiError.from_protocol(exc) from None
            reason = "load"
        body = loaded_object(ollama.kind, ollama.model, reason)
        content_type = "application/x-ndjson" if ollama.stream else "application/json"
        HttpAnswer(route.out, route.headers).respond(
            HTTPStatus.OK, body + b"\n" if ollama.stream else body, content_type
        )

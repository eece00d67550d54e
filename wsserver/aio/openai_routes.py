"""The OpenAI API's routes: chat completions, completions, the models.

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` — the body
  parsed (:func:`wsserver.dialects.openai.api.parse_request`) and run on the HTTP
  exchange (:mod:`wsserver.aio.exchange`) with OpenAI's renderer
  (:class:`wsserver.dialects.openai.render.CompletionAnswer`): SSE chunks with
  ``stream``, else the whole JSON body;
* ``GET /v1/models`` and ``GET /v1/models/{model}`` — every served model
  (the default first), or one by its name or an alias.

They are registered with the others in :func:`wsserver.aio.http_router.api_routes`.
"""

from __future__ import annotations

from functools import partial
from http import HTTPStatus

from ..dialects.api_errors import ApiError
from ..dialects.openai.api import Kind, models_body, parse_request
from ..dialects.openai.render import CompletionAnswer
from .exchange import Exchange
from .http_route import RouteRequest, clip, no_route, not_allowed
from .services import Services

__all__ = ["CompletionsRoute", "ModelsRoute"]


class CompletionsRoute:
    """``POST /v1/chat/completions`` (``chat``) or ``POST /v1/completions`` (``completion``)."""

    def __init__(self, services: Services, kind: Kind, path: str) -> None:
        self._services = services
        self._kind: Kind = kind
        self._path = path

    async def __call__(self, request: RouteRequest) -> None:
        if request.path != self._path:
            raise no_route(request.method, request.path)
        if request.method != "POST":
            raise not_allowed(request.method, "POST")
        api = parse_request(
            self._kind, request.body, request.request_id, self._services.wire_limits
        )
        exchange = Exchange(request, self._services)
        await exchange.run(api.generate, api.model, partial(CompletionAnswer, api))


class ModelsRoute:
    """``GET /v1/models`` and ``GET /v1/models/{model}``."""

    def __init__(self, services: Services) -> None:
        self._services = services

    async def __call__(self, request: RouteRequest) -> None:
        models = self._services.models
        path = request.path
        name = path[len("/v1/models/") :] if path.startswith("/v1/models/") else None
        if name is not None and name not in models.models and name not in models.aliases:
            raise ApiError(
                HTTPStatus.NOT_FOUND, f"the model {clip(name)!r} does not exist", "model_not_found"
            )
        if request.method not in ("GET", "HEAD"):
            raise not_allowed(request.method, "GET")
        if name is None:
            body = models_body(models.infos())
        else:
            body = models_body([models.resolve(name).info()], single=True)
        request.out.simple(HTTPStatus.OK, body, request.headers)

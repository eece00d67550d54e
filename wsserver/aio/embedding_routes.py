"""The embeddings and rerank routes: ``POST /v1/embeddings``, ``POST /v1/rerank`` (and ``/rerank``).

Each body is parsed by its dialect (:mod:`wsserver.dialects.embeddings.api`)
and run on the HTTP exchange (:meth:`wsserver.aio.exchange.Exchange.run_embed`):
the model resolved once, its scheduler and engine as a generation's, a
disconnect a cancel; the answer rendered whole
(:mod:`wsserver.dialects.embeddings.render`). Registered with the other
routes in :func:`wsserver.aio.http_router.api_routes`.
"""

from __future__ import annotations

from ..dialects.embeddings.api import parse_embeddings, parse_rerank
from ..dialects.embeddings.render import embeddings_body, rerank_body
from .exchange import Exchange
from .http_route import RouteRequest, no_route, not_allowed
from .services import Services

__all__ = ["EmbeddingsRoute", "RerankRoute"]


class EmbeddingsRoute:
    """``POST /v1/embeddings``."""

    def __init__(self, services: Services, path: str = "/v1/embeddings") -> None:
        self._services = services
        self._path = path

    async def __call__(self, request: RouteRequest) -> None:
        if request.path != self._path:
            raise no_route(request.method, request.path)
        if request.method != "POST":
            raise not_allowed(request.method, "POST")
        api = parse_embeddings(request.body, request.request_id)
        exchange = Exchange(request, self._services)
        await exchange.run_embed(
            api.embed,
            api.model,
            lambda result, model: embeddings_body(result, model=model, encoding=api.encoding),
        )


class RerankRoute:
    """``POST /v1/rerank`` (and ``/rerank``, where llama-server and Jina's clients look)."""

    def __init__(self, services: Services, path: str) -> None:
        self._services = services
        self._path = path

    async def __call__(self, request: RouteRequest) -> None:
        if request.path != self._path:
            raise no_route(request.method, request.path)
        if request.method != "POST":
            raise not_allowed(request.method, "POST")
        api = parse_rerank(request.body, request.request_id)
        exchange = Exchange(request, self._services)
        await exchange.run_embed(
            api.embed, api.model, lambda result, model: rerank_body(result, api, model=model)
        )

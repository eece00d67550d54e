"""The embeddings and rerank routes: ``POST /v1/embeddings``, ``POST /v1/rerank`` (and ``/rerank``).

Each body is parsed by its dialect (:mod:`wsserver.dialects.embeddings.api`)
and run on the HTTP exchange (:meth:`wsserver.aio.exchange.Exchange.run_embed`):
the model resolved once, its scheduler and engine as a generation's, a
disconnect a cancel; the answer rendered whole
(:mod:`wsserver.dialects.embeddings.render`). Registered with the other
routes in :func:`wsserver.aio.http_router.api_routes`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.embedding import Embed, Embedded
from ..dialects.embeddings.api import parse_embeddings, parse_rerank
from ..dialects.embeddings.render import embeddings_body, rerank_body
from .exchange import Exchange
from .http_route import RouteRequest, no_route, not_allowed
from .services import Services

__all__ = ["embeddings_route", "rerank_route"]


Render = Callable[[Embedded, str], bytes]


def _embeddings(request: RouteRequest) -> tuple[Embed, str | None, Render]:
    api = parse_embeddings(request.body, request.request_id)
    return (
        api.embed,
        api.model,
        lambda result, model: embeddings_body(result, model=model, encoding=api.encoding),
    )


def _rerank(request: RouteRequest) -> tuple[Embed, str | None, Render]:
    api = parse_rerank(request.body, request.request_id)
    return api.embed, api.model, lambda result, model: rerank_body(result, api, model=model)


class _EmbedRoute:
    """One path, POST only: its body parsed by ``parse`` (the request, the
    model asked for, the renderer) and run on the exchange."""

    def __init__(
        self,
        services: Services,
        path: str,
        parse: Callable[[RouteRequest], tuple[Embed, str | None, Render]],
    ) -> None:
        self._services = services
        self._path = path
        self._parse = parse

    async def __call__(self, request: RouteRequest) -> None:
        if request.path != self._path:
            raise no_route(request.method, request.path)
        if request.method != "POST":
            raise not_allowed(request.method, "POST")
        embed, model, render = self._parse(request)
        await Exchange(request, self._services).run_embed(embed, model, render)


def embeddings_route(services: Services, path: str = "/v1/embeddings") -> _EmbedRoute:
    """``POST /v1/embeddings``."""
    return _EmbedRoute(services, path, _embeddings)


def rerank_route(services: Services, path: str) -> _EmbedRoute:
    """``POST /v1/rerank`` (and ``/rerank``, where llama-server and Jina's clients look)."""
    return _EmbedRoute(services, path, _rerank)

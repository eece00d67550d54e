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

* ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``
  — the models served, one model, the loaded ones, the API's version
  (:mod:`wsserver.dialects.ollama.catalog`); a GGUF's details and template
  from its file's header, read on a worker thread and kept per file (its
  path, size and time);
* ``POST /api/pull`` — the server's pull of a Hugging Face model
  (:class:`~wsserver.aio.pulls.Pulls`: one download per reference, shared
  with a WebSocket ``pull`` of it or a model loading from it), where the
  operator lets clients pull (as for the WebSocket ``pull``); its progress
  as Ollama's status objects, then ``{"status": "success"}`` with the model
  served. A client that goes leaves the download, which stops if nobody
  else waits for it;
* ``POST /api/embed`` and ``POST /api/embeddings`` — vectors
  (:mod:`wsserver.dialects.ollama.embed`: L2-normalised on ``/api/embed``,
  as Ollama's) from the model's embedding work, on the HTTP exchange as
  ``/v1/embeddings`` runs: the model's queue and engine, cancelled by a
  disconnect; nothing to embed loads (or unloads) the model;
* the endpoints this server does not have (``/api/create``, ``/api/copy``,
  ``/api/delete``, ``/api/push``, ``/api/blobs/…``) — a 501 naming what is
  not supported.

``HEAD /`` and ``GET /``, which Ollama's tools use to see a server is up,
are the chat page's (200), answered by the plain routes.

Every refusal and failure is Ollama's ``{"error": "…"}``
(:func:`wsserver.dialects.ollama.api.error_body`; the transport uses it for
this path's refusals too, the gate's 401 included): before the head, as the
response with its status; after it, as the stream's last line.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

from ..backends.gguf_meta import read_metadata
from ..config import MODEL_NAME_RE
from ..core.embedding import Embedded
from ..dialects.api_errors import ApiError, parse_json
from ..dialects.ollama.api import Kind, OllamaRequest, parse_chat, parse_generate
from ..dialects.ollama.catalog import (
    HEADER_KEYS,
    ModelFacts,
    Running,
    capabilities,
    digest_of,
    facts_from_header,
    hub_reference,
    listed_name,
    ps_body,
    show_body,
    tags_body,
    unsupported,
    version_body,
)
from ..dialects.ollama.embed import embed_body, legacy_body, parse_embed, parse_legacy
from ..dialects.ollama.options import check_num_ctx
from ..dialects.ollama.render import OllamaAnswer, loaded_object
from ..errors import ProtocolError, PullError
from ..pull.reference import parse_reference
from .exchange import Exchange
from .http_answer import HttpAnswer
from .http_route import RouteRequest, clip, no_route, not_allowed
from .models import Model, ModelPool
from .ollama_pull import PullAnswer
from .pull_requests import pull_refusal
from .services import Services

__all__ = ["PREFIX", "OllamaRoute", "served_name"]

PREFIX: Final = "/api"
#: The tag Ollama gives a name that has none.
LATEST: Final = ":latest"
#: ``expires_at`` of a model kept until its memory is needed.
FOREVER: Final = "9999-12-31T23:59:59Z"
#: llama.cpp's pooling type of a reranker (a GGUF's ``{arch}.pooling_type``).
_RANK_POOLING: Final = 4
#: The POST endpoints.
_POSTS: Final = (
    "/api/chat",
    "/api/generate",
    "/api/show",
    "/api/pull",
    "/api/embed",
    "/api/embeddings",
)
#: The GET endpoints, and what each answers.
_LISTINGS: Final = ("/api/tags", "/api/ps", "/api/version")


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
        #: A GGUF's facts, by (path, size, time): its header is read once.
        self._files: dict[tuple[str, int, int], dict[str, Any]] = {}

    async def __call__(self, request: RouteRequest) -> None:
        path, method = request.path, request.method
        refusal = unsupported(path)
        if refusal is not None:
            raise refusal
        if path in _POSTS:
            if method != "POST":
                raise not_allowed(method, "POST")
            if path == "/api/show":
                await self._show(request)
            elif path == "/api/pull":
                await self._pull(request)
            elif path in ("/api/embed", "/api/embeddings"):
                await self._embed(request, legacy=path == "/api/embeddings")
            else:
                await self._generate(request, "chat" if path == "/api/chat" else "generate")
            return
        if path in _LISTINGS:
            if method not in ("GET", "HEAD"):
                raise not_allowed(method, "GET")
            if path == "/api/tags":
                body = tags_body([await self._facts(m, name) for m, name in self._names()])
            elif path == "/api/ps":
                body = ps_body(await self._running())
            else:
                body = version_body()
            request.out.simple(HTTPStatus.OK, body, request.headers)
            return
        raise no_route(method, path)

    # ------------------------------------------------------------ pulls

    async def _pull(self, route: RouteRequest) -> None:
        services = self._services
        obj = parse_json(route.body)
        for key in obj:
            if key not in ("model", "name", "stream", "insecure"):
                raise ApiError(
                    HTTPStatus.BAD_REQUEST, f"{clip(str(key))}: unknown field", "bad_request"
                )
        name = obj.get("model", obj.get("name"))
        stream = obj.get("stream", True)
        if not isinstance(name, str) or not name:
            raise ApiError(HTTPStatus.BAD_REQUEST, "model is required", "bad_request")
        if not isinstance(stream, bool):
            raise ApiError(HTTPStatus.BAD_REQUEST, "stream: must be true or false", "bad_request")
        refusal = pull_refusal(services.config) if services.pulls is not None else "no pulls here"
        if refusal is not None:
            raise ApiError(HTTPStatus.FORBIDDEN, refusal, "pull_not_allowed")
        assert services.pulls is not None
        try:
            reference = parse_reference(hub_reference(name))
        except PullError as exc:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"{exc.message} (a model here is pulled from Hugging Face: org/repo:QUANT,"
                " or hf.co/org/repo:QUANT as Ollama takes it)",
                exc.code,
            ) from None
        if not MODEL_NAME_RE.fullmatch(reference.name):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"{clip(reference.name)!r} cannot be a model's name here",
                "bad_reference",
            )
        route.log.request(route.request_id).info("pull %s", reference.text)
        subscription = services.pulls.start(reference)
        try:
            await PullAnswer(route, stream).run(subscription, services)
        finally:
            subscription.on_progress = None
            subscription.leave()  # gone, failed or done: nothing keeps the download for us

    # ------------------------------------------------------------ the models

    def _served(self) -> list[Model]:
        return list(self._services.models.models.values())

    def _names(self) -> list[tuple[Model, str]]:
        """Every name a request may give, with its model: a model's name, or
        each of the models an engine serves (an upstream's, as
        ``GET /v1/models`` lists them)."""
        names: list[tuple[Model, str]] = []
        for model in self._served():
            served = model.backend.served_models()
            names.extend((model, name) for name in (served or [model.name]))
        return names

    async def _show(self, route: RouteRequest) -> None:
        obj = parse_json(route.body)
        name = obj.get("model", obj.get("name"))  # "name": older clients'
        if not isinstance(name, str) or not name:
            raise ApiError(HTTPStatus.BAD_REQUEST, "model is required", "bad_request")
        _, model = served_name(self._services.models, name, route.request_id)
        facts = await self._facts(model, name)
        route.out.simple(HTTPStatus.OK, show_body(facts), route.headers)

    async def _running(self) -> list[Running]:
        models = self._services.models
        now = datetime.now(UTC)
        running = []
        for model in self._served():
            if model.state != "loaded":
                continue
            wait = models.expires_in(model)
            expires = (
                FOREVER
                if wait is None
                else (now + timedelta(seconds=wait)).isoformat().replace("+00:00", "Z")
            )
            facts = await self._facts(model, model.name)
            running.append(Running(facts, model.bytes, expires))
        return running

    async def _facts(self, model: Model, name: str) -> ModelFacts:
        """What Ollama's endpoints say about ``model`` (listed as ``name``)."""
        backend = model.backend
        listed = listed_name(name)
        tools = "tools" in backend.honours
        info = model.info()
        n_ctx, modalities = info.n_ctx, info.input_modalities or ()
        try:
            facts = await asyncio.to_thread(self._file_facts, backend.model_file)
        except Exception as exc:  # a missing or corrupt file: said, not fatal
            raise ApiError(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                f"cannot read the model file of {model.name!r}: {exc}",
                "internal",
            ) from None
        if facts is None:  # no file here (an upstream's model)
            embeds = info.embeddings == "embed"
            return ModelFacts(
                listed,
                capabilities=capabilities(
                    tools=tools, template="", embedding=embeds, modalities=modalities
                ),
                context_length=n_ctx,
            )
        key, found = facts
        if key not in self._files:
            # One entry per file: a replaced file's old entry goes.
            for old in [k for k in self._files if k[0] == key[0]]:
                del self._files[old]
            self._files[key] = found
        header = found["header"]
        template = header["template"]
        pooling = header["model_info"].get(f"{header['family']}.pooling_type")
        encoder = isinstance(pooling, int) and pooling > 0
        embeds = (
            info.embeddings == "embed"
            if info.embeddings is not None
            else encoder and pooling != _RANK_POOLING
        )
        return ModelFacts(
            listed,
            size=found["size"],
            modified_at=found["modified_at"],
            digest=found["digest"],
            capabilities=capabilities(
                tools=tools,
                template=template,
                embedding=embeds,
                encoder=encoder,
                modalities=modalities,
            ),
            context_length=n_ctx,
            **header,
        )

    def _file_facts(
        self, file_of: Callable[[], Path | None]
    ) -> tuple[tuple[str, int, int], dict[str, Any]] | None:
        """A GGUF's file facts and header, and the key they are kept under
        (a worker thread's: the loop keeps them); ``None``: no file."""
        found = file_of()
        if found is None:
            return None
        path = str(found)
        stat = os.stat(path)
        key = (path, stat.st_size, stat.st_mtime_ns)
        known = self._files.get(key)
        if known is None:
            wanted = set(HEADER_KEYS)
            header = facts_from_header(read_metadata(path, wanted))
            modified = datetime.fromtimestamp(stat.st_mtime, UTC)
            known = {
                "size": stat.st_size,
                "modified_at": modified.isoformat().replace("+00:00", "Z"),
                "digest": digest_of(path, stat.st_size, stat.st_mtime_ns),
                "header": header,
            }
        return key, known

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

    async def _embed(self, route: RouteRequest, *, legacy: bool) -> None:
        """``/api/embed`` (``legacy``: ``/api/embeddings``) on the HTTP exchange
        (:mod:`wsserver.dialects.ollama.embed`)."""
        services = self._services
        parse = parse_legacy if legacy else parse_embed
        ollama = parse(parse_json(route.body), route.request_id)
        served, model = served_name(services.models, ollama.model, route.request_id)

        def render(result: Embedded | None, _: str) -> bytes:
            if legacy:
                return legacy_body(result)
            if result is None:
                return embed_body(None, model=ollama.model)
            return embed_body(
                result, model=ollama.model, total_ms=result.total_ms, queued_ms=result.queued_ms
            )

        if ollama.embed is None:  # nothing to embed: load (or unload) the model
            await self._warm(route, model, ollama.keep_alive)
            route.out.simple(HTTPStatus.OK, render(None, served), route.headers)
            return
        embed = replace(ollama.embed, keep_alive=ollama.keep_alive)
        await Exchange(route, services).run_embed(embed, served, render, model=model)

    async def _warm(self, route: RouteRequest, model: Model, keep_alive: float | None) -> str:
        """Load ``model``, or unload it (``keep_alive`` 0): ``load`` or ``unload``."""
        models = self._services.models
        if keep_alive == 0:
            models.expire(model)
            return "unload"
        try:
            await models.warm(model, route.request_id, keep_alive)
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc) from None
        return "load"

    async def _load(self, route: RouteRequest, ollama: OllamaRequest, model: Model) -> None:
        """Nothing to answer: load the model, or unload it (``keep_alive`` 0)."""
        reason = await self._warm(route, model, ollama.keep_alive)
        body = loaded_object(ollama.kind, ollama.model, reason)
        content_type = "application/x-ndjson" if ollama.stream else "application/json"
        HttpAnswer(route.out, route.headers).respond(
            HTTPStatus.OK, body + b"\n" if ollama.stream else body, content_type
        )

"""One Ollama ``/api/pull``'s answer: the pull's progress as Ollama's status
objects (NDJSON), then ``{"status": "success"}`` with the model served — or,
not streamed, that one object (used by :mod:`.ollama_http`)."""

from __future__ import annotations

import asyncio
from asyncio import FIRST_COMPLETED
from http import HTTPStatus
from typing import Any

import orjson

from ..dialects.exchange import SHUTTING_DOWN
from ..dialects.ollama.api import error_object
from ..dialects.ollama.catalog import PULL_STATUS, pull_status
from ..dialects.ollama.render import MEDIA_TYPE as NDJSON
from ..errors import PullError
from ..pull.hub import PullCancelled
from ..pull.progress import Progress
from .http_answer import HttpAnswer
from .http_route import RouteRequest
from .pulls import Subscription
from .services import Services

__all__ = ["PullAnswer"]


class PullAnswer:
    """One ``/api/pull``'s answer, and the :class:`~wsserver.aio.http_route.Running`
    its connection tells of a disconnect or the server's shutdown."""

    def __init__(self, route: RouteRequest, stream: bool) -> None:
        self._route = route
        self._stream = stream
        self._answer = HttpAnswer(route.out, route.headers, keepalive=b"", media_type=NDJSON)
        loop = asyncio.get_running_loop()
        #: How it ended early: "gone" (the client) or "shutdown".
        self._ended: asyncio.Future[str] = loop.create_future()
        self._latest: Progress | None = None
        self._news = asyncio.Event()

    # The connection's calls.

    def client_gone(self) -> None:
        if not self._ended.done():
            self._ended.set_result("gone")

    def cancel(self) -> None:
        if not self._ended.done():
            self._ended.set_result("shutdown")

    def stall(self) -> None:
        """A pull holds no model: a client that reads slowly only hears less often."""

    async def run(self, subscription: Subscription, services: Services) -> None:
        route, answer = self._route, self._answer
        route.begin(self)
        subscription.on_progress = self._progressed
        result = asyncio.ensure_future(subscription.wait())
        try:
            if self._stream:
                answer.head()
            while not result.done():
                news = asyncio.ensure_future(self._news.wait())
                waiting: set[asyncio.Future[Any]] = {result, news, self._ended}
                await asyncio.wait(waiting, return_when=FIRST_COMPLETED)
                news.cancel()
                if self._ended.done():
                    self._end_early()
                    return
                latest, self._latest = self._latest, None
                self._news.clear()
                if self._stream and latest is not None and not result.done():
                    await answer.write(_line(pull_status(latest)))
            try:
                pulled = result.result()
            except PullError as exc:
                route.log.request(route.request_id).info(
                    "pull failed: %s %s", exc.code, exc.message
                )
                self._fail(PULL_STATUS.get(exc.code, HTTPStatus.BAD_GATEWAY), exc.message)
                return
            except PullCancelled:
                self._fail(HTTPStatus.SERVICE_UNAVAILABLE, SHUTTING_DOWN)
                return
            model = services.models.add_pulled(services.config, pulled)
            route.log.request(route.request_id).info(
                "pulled %s as model %s", pulled.plan.reference.text, model.name
            )
            if self._stream:
                answer.write_last(_line({"status": "success"}))
            else:
                answer.respond(HTTPStatus.OK, orjson.dumps({"status": "success"}))
        finally:
            if not result.done():
                result.cancel()

    def _progressed(self, progress: Progress) -> None:
        self._latest = progress  # the latest replaces one not written yet
        self._news.set()

    def _end_early(self) -> None:
        if self._ended.result() == "shutdown":
            self._fail(HTTPStatus.SERVICE_UNAVAILABLE, SHUTTING_DOWN)
        else:
            self._answer.finish()  # nobody to tell

    def _fail(self, status: int, message: str) -> None:
        if self._stream:
            self._answer.write_last(_line(error_object(message)))
        else:
            self._answer.respond(status, orjson.dumps(error_object(message)))


def _line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj) + b"\n"

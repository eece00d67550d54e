"""The relay's embedding door: ``/v1/embeddings`` and ``/v1/rerank`` passed to an upstream.

An embedding or rerank request on the openai relay goes to one upstream —
the healthy one with the fewest requests in flight, among those that list
the model when routing by model — as one whole POST: ``/v1/embeddings``
asking for base64 vectors (decoded here; an upstream that answers float
lists anyway is read too), ``/v1/rerank`` with every document and its own
``top_n`` (the dialect sorts and cuts). The upstream's answer becomes the
core's :class:`~wsserver.core.embedding.Embedded`, so every wire renders it
as for a local model. An upstream without the endpoint (404, 405, 501) is
refused by name (``unsupported_option``); its other errors keep their
message; a cancel (the client gone) cancels the request upstream at once.
The answer is read within :data:`MAX_ANSWER_BYTES` (the vectors' own bound,
as JSON).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
from collections.abc import Callable
from typing import Any, Final

import aiohttp
import orjson

from ..core.embedding import MAX_VECTOR_BYTES, Embed, Embedded
from ..errors import WireCode
from ..logs import context
from .embed_door import EmbedDoor, EmbedSubmission
from .handles import CancelEvent
from .openai_relay import call_soon
from .openai_upstream import MAX_ERROR_BODY, Upstream
from .openai_wire import UpstreamError, error_message

__all__ = ["MAX_ANSWER_BYTES", "RelayEmbedDoor"]

log = logging.getLogger("wsserver.openai")

#: An upstream's whole answer at most: the vectors' bound as float text.
MAX_ANSWER_BYTES: Final = 4 * MAX_VECTOR_BYTES
_ACCEPT_JSON: Final = {"Accept": "application/json"}
#: Statuses that say the upstream has no such endpoint.
_NO_ENDPOINT: Final = frozenset({404, 405, 501})


class RelayEmbedDoor(EmbedDoor):
    """Embeddings and rerank on the relay (see the module docstring)."""

    def __init__(
        self,
        *,
        session: Callable[[], aiohttp.ClientSession],
        pick: Callable[[str], Upstream | None],
        target: Callable[[str | None], str],
        timeout_s: float,
    ) -> None:
        self._session = session
        self._pick = pick
        self._target = target
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def kind(self) -> str:
        return "embed"  # and rerank: the upstream says what it serves

    def start(self, request: Embed, *, cancel: CancelEvent) -> EmbedSubmission:
        loop = asyncio.get_running_loop()
        submission = EmbedSubmission()
        task = loop.create_task(self._serve(request, submission))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        cancel.add_callback(lambda: call_soon(loop, task.cancel))
        return submission

    async def _serve(self, request: Embed, submission: EmbedSubmission) -> None:
        try:
            submission.finish(await self._ask(request))
        except asyncio.CancelledError:
            pass  # the client is gone: nothing to answer
        except UpstreamError as exc:
            submission.fail(exc.code, str(exc))
        except Exception:
            log.exception(
                "id=%s relaying an embedding request failed",
                request.id,
                extra=context(request.conn_id, request.id),
            )
            submission.fail("internal", "the backend failed")
        finally:
            submission.complete()

    async def _ask(self, request: Embed) -> Embedded:
        model = self._target(request.model)
        if not model:
            raise UpstreamError(
                "no upstream has listed a model at /v1/models yet", code="upstream_unavailable"
            )
        upstream = self._pick(model)
        if upstream is None:
            raise UpstreamError(
                f"no upstream serving {model!r} is reachable", code="upstream_unreachable"
            )
        rerank = request.kind == "rerank"
        path = "/rerank" if rerank else "/embeddings"
        inputs = [item if isinstance(item, str) else list(item) for item in request.inputs]
        body: dict[str, Any] = (
            {"model": model, "query": request.query, "documents": inputs, "top_n": len(inputs)}
            if rerank
            else {"model": model, "input": inputs, "encoding_format": "base64"}
        )
        upstream.in_flight += 1
        upstream.requests += 1
        try:
            async with (
                asyncio.timeout(self._timeout_s),
                self._session().post(
                    upstream.url + path, data=orjson.dumps(body), headers=_ACCEPT_JSON
                ) as response,
            ):
                if response.status in _NO_ENDPOINT:
                    what = "rerank is" if rerank else "embeddings are"
                    raise UpstreamError(
                        f"{what} not served by the upstream {upstream.url} "
                        f"(its {path} answered {response.status})",
                        code="unsupported_option",
                    )
                if response.status >= 400:
                    text = await response.content.read(MAX_ERROR_BODY)
                    code: WireCode = (
                        "upstream_rejected" if response.status < 500 else "upstream_failed"
                    )
                    raise UpstreamError(error_message(response.status, text), code=code)
                raw = await response.content.read(MAX_ANSWER_BYTES + 1)
        except TimeoutError:
            upstream.errors += 1
            raise UpstreamError(
                f"the upstream did not answer within {self._timeout_s:g} s", code="upstream_timeout"
            ) from None
        except aiohttp.ClientError as exc:
            upstream.errors += 1
            raise UpstreamError(
                f"cannot reach the upstream {upstream.url}: {exc.__class__.__name__}",
                code="upstream_unreachable",
            ) from None
        finally:
            upstream.in_flight -= 1
        if len(raw) > MAX_ANSWER_BYTES:
            raise UpstreamError(
                f"the upstream's answer is more than {MAX_ANSWER_BYTES} bytes",
                code="upstream_bad_stream",
            )
        try:
            answer = orjson.loads(raw)
            return _scores(answer, len(inputs)) if rerank else _vectors(answer, len(inputs))
        except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            raise UpstreamError(
                f"the upstream's answer is not OpenAI's shape ({exc.__class__.__name__})",
                code="upstream_bad_stream",
            ) from None


def _tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage") or {}
    tokens = usage.get("prompt_tokens", usage.get("total_tokens", 0))
    return tokens if isinstance(tokens, int) else 0


def _index(item: dict[str, Any], count: int) -> int:
    index = item["index"]
    if not isinstance(index, int) or not 0 <= index < count:
        raise ValueError("an index outside the inputs")
    return index


def _vectors(answer: dict[str, Any], count: int) -> Embedded:
    """``/v1/embeddings``' answer: each item's vector (base64 float32 or a
    float list) in input order, checked to be one per input, of one width."""
    vectors: list[bytes | None] = [None] * count
    for item in answer["data"]:
        value = item["embedding"]
        vector = (
            base64.b64decode(value, validate=True)
            if isinstance(value, str)
            else struct.pack(f"<{len(value)}f", *value)
        )
        vectors[_index(item, count)] = vector
    widths = {len(v) for v in vectors if v is not None}
    if None in vectors or len(widths) != 1 or 0 in widths or widths.pop() % 4:
        raise ValueError("not one vector of one width per input")
    done = tuple(v for v in vectors if v is not None)
    return Embedded(vectors=done, prompt_tokens=_tokens(answer), dimensions=len(done[0]) // 4)


def _scores(answer: dict[str, Any], count: int) -> Embedded:
    """``/v1/rerank``'s answer: each document's score in input order."""
    scores: list[float | None] = [None] * count
    for item in answer["results"]:
        scores[_index(item, count)] = float(item["relevance_score"])
    if None in scores:
        raise ValueError("not one score per document")
    return Embedded(scores=tuple(s for s in scores if s is not None), prompt_tokens=_tokens(answer))

"""The upstream engine: relay an OpenAI-compatible server, on the event loop.

llama-server, vLLM, SGLang, Ollama, LM Studio and llama_cpp.server all
stream ``/v1/completions`` and ``/v1/chat/completions`` as server-sent
events. This engine is the seam's third kind (see
:mod:`wsserver.backends.base`): ``submit`` starts one task per request on the
loop — no thread — that

* picks the healthy upstream with the fewest requests in flight and POSTs
  the request with ``stream: true`` (:mod:`.openai_wire`; the exchange with
  one upstream is :func:`.openai_upstream.exchange`);
* reads the response body a chunk at a time, but only once the request's
  channel has room (``offer`` / ``when_room``): a client that stops reading
  stops the reading of its own upstream response, TCP pushes back to the
  upstream, and what wsserver holds per request stays bounded (the channel's
  pieces, aiohttp's read buffer of ``READ_BUFSIZE``, the socket buffers);
* passes the text through :class:`~wsserver.core.textstream.TextAssembler` with
  the request's stop strings, as every engine does — the upstream applies
  them too, so this only matters for one that ignores ``stop``;
* ends with the upstream's ``finish_reason`` and ``usage``.

Cancel cancels the task; whatever it awaits raises at once and the response
is closed, not released — the connection is dropped, which is how an OpenAI
server learns that its client left and aborts the generation.

Every failure ends the request with a specific ``upstream_*`` wire code
(:class:`~.openai_wire.UpstreamError`). A request that failed before any of
its text was taken is retried once on another healthy upstream. An upstream
that failed as a whole (unreachable, 5xx, a timeout, a broken stream) is out
of rotation for a backoff period and comes back once ``/v1/models`` answers.

Why aiohttp: one well-kept dependency that streams a response without
buffering it, pools connections per host, and whose ``close()`` drops the
socket at once; its server side lets the tests run a real fault-injecting
upstream. See docs/upstream.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import urllib.error
import urllib.request

import aiohttp

from ..config import OpenAIConfig
from ..core.sampling import NEUTRAL
from ..core.textstream import TextAssembler
from ..logs import context
from .base import (
    Backend,
    CancelEvent,
    GenerationRequest,
    Outcome,
    OutputFormat,
    Sink,
    Submission,
    UpstreamStats,
)
from .openai_embed import RelayEmbedDoor
from .openai_relay import Relay, call_soon
from .openai_upstream import MAX_ERROR_BODY, Upstream, exchange
from .openai_wire import UpstreamError

__all__ = ["OpenAIBackend", "Upstream"]

log = logging.getLogger("wsserver.producer")

#: aiohttp's read buffer per response: above it, it stops reading the socket.
READ_BUFSIZE = 16384
#: The longest model name shown (hello, chunks, metrics, logs) from an upstream's listing.
MAX_MODEL_NAME = 256
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def display_name(model: str) -> str:
    """An upstream's model id as wsserver shows it: control characters
    replaced, at most :data:`MAX_MODEL_NAME` characters. The upstream is still
    asked for the id it listed."""
    name = _UNPRINTABLE.sub("?", model)
    return name if len(name) <= MAX_MODEL_NAME else name[: MAX_MODEL_NAME - 1] + "…"


class OpenAIBackend(Backend):
    """Relays each request to one of ``urls`` (see the module docstring)."""

    #: Every option is forwarded to the upstream, which honours or refuses it
    #: (``tool_choice`` too: "required" and a named function; a reasoning
    #: budget as llama-server's ``reasoning_budget_tokens``, docs/upstream.md).
    honours = frozenset(NEUTRAL) | {"tool_choice", "reasoning_budget_tokens"}

    def output_format(self, request: GenerationRequest) -> OutputFormat:
        """The upstream parses its model's calls and streams them as
        ``tool_calls``: the relay hands them over as parts (``relay``)."""
        return OutputFormat(tool_syntax="relay")

    def __init__(
        self,
        *,
        urls: list[str],
        api_key: str = "",
        model: str = "",
        parallel: int = 4,
        max_waiting: int = 64,
        connect_timeout_s: float = 5.0,
        first_byte_timeout_s: float = 120.0,
        silence_timeout_s: float = 30.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        if not urls:
            raise ValueError("at least one upstream URL")
        self.upstreams = [Upstream(url.rstrip("/")) for url in urls]
        self.model = model
        #: A model was configured: every upstream is asked for it.
        self.configured = bool(model)
        self.model_name = model or "openai"
        self.slots = parallel * len(urls)
        self.max_waiting = max_waiting
        self.parallel = parallel
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.silence_timeout_s = silence_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # identity: a compressed body could expand a thousandfold before any
        # bound applies (a gzip bomb); a server that compresses anyway is refused.
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
        }
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Looks for a model while no upstream has listed one (started late).
        self._discovery: asyncio.Task[None] | None = None
        #: /v1/embeddings and /v1/rerank, passed through (:mod:`.openai_embed`).
        self._embed_door = RelayEmbedDoor(
            session=self._session,
            pick=lambda model: self.pick(model=model),
            target=self._target,
            timeout_s=first_byte_timeout_s,
        )

    @classmethod
    def from_config(cls, config: OpenAIConfig) -> OpenAIBackend:
        return cls(
            urls=list(config.urls),
            api_key=config.api_key,
            model=config.model,
            parallel=config.parallel,
            max_waiting=config.max_waiting,
            connect_timeout_s=config.connect_timeout_s,
            first_byte_timeout_s=config.first_byte_timeout_s,
            silence_timeout_s=config.silence_timeout_s,
        )

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Find the model to ask for, if none is configured (on a worker thread).

        If no upstream answers yet (a fleet that boots slower than wsserver),
        the server starts anyway: ``/readyz`` is 503 and requests get
        ``upstream_unavailable`` until an upstream lists a model
        (:meth:`unready_reason` keeps looking)."""
        if self.model:
            self.model_name = display_name(self.model)
            return
        reasons = []
        for upstream in self.upstreams:
            try:
                upstream.models = self._listing(upstream.url)
            except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                reasons.append(f"{upstream.url}: {exc.__class__.__name__}")
                continue
            if not self.model:
                self._found(upstream.models[0])
        if not self.model:
            log.warning(
                "no upstream listed a model at /v1/models (%s); serving once one does",
                "; ".join(reasons),
            )
        elif reasons:
            log.warning(
                "upstream(s) not listing their models yet (%s): they get requests "
                "for their models once they do",
                "; ".join(reasons),
            )

    def _found(self, model: str) -> None:
        self.model = model
        self.model_name = display_name(model)

    def _listing(self, url: str) -> tuple[str, ...]:
        request = urllib.request.Request(f"{url}/models", headers=self._headers)
        timeout = self.connect_timeout_s + self.first_byte_timeout_s
        with urllib.request.urlopen(request, timeout=timeout) as response:
            listing = json.loads(response.read(MAX_ERROR_BODY * 16))
        return _models_of(listing)

    @property
    def _routing(self) -> bool:
        """Requests go to the upstreams that list their model (no
        ``backend.openai.model`` configured: each upstream serves what it lists)."""
        return not self.configured

    def served_models(self) -> dict[str, bool] | None:
        """Without a configured model: every model an upstream lists, and
        whether a healthy upstream lists it (docs/upstream.md, "Several models")."""
        if not self._routing:
            return None
        if any(not u.models for u in self.upstreams):
            with contextlib.suppress(RuntimeError):  # (no running loop: nothing to start)
                self._look_for_a_model()
        served: dict[str, bool] = {}
        for upstream in self.upstreams:
            for model in upstream.models:
                served[model] = served.get(model, False) or upstream.healthy
        return served

    async def _fetch_listing(self, upstream: Upstream) -> bool:
        """Ask one upstream's ``/v1/models``; whether it answered with a listing."""
        with contextlib.suppress(
            TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError
        ):
            async with asyncio.timeout(self.connect_timeout_s + self.silence_timeout_s):
                async with self._session().get(upstream.url + "/models") as response:
                    body = await response.content.read(MAX_ERROR_BODY * 16)
            if response.status == 200:
                upstream.models = _models_of(json.loads(body))
                log.info("upstream %s lists %s", upstream.url, ", ".join(upstream.models[:20]))
                return True
        return False

    async def _discover(self) -> None:
        """Ask the upstreams' ``/v1/models`` until one lists a model (and, when
        routing by model, until each has listed its own)."""
        delay = self.backoff_s
        try:
            while not self.model or (self._routing and any(not u.models for u in self.upstreams)):
                for upstream in self.upstreams:
                    if upstream.models or not await self._fetch_listing(upstream):
                        continue
                    if not self.model:
                        self._found(upstream.models[0])
                        if self.on_model is not None:
                            self.on_model(self.model_name)
                if self.model and not (self._routing and any(not u.models for u in self.upstreams)):
                    return
                await asyncio.sleep(delay)  # sleep-ok: the probe's backoff
                delay = min(delay * 2, self.max_backoff_s)
        finally:
            self._discovery = None

    def close(self) -> None:
        """Close the connection pool (called on a worker thread, the loop running)."""
        loop, client = self._loop, self._client
        if client is None or loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            asyncio.run_coroutine_threadsafe(self._aclose(), loop).result(timeout=10)

    async def _aclose(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        for upstream in self.upstreams:
            if upstream.probe is not None:
                upstream.probe.cancel()
        if self._client is not None:
            await self._client.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            self._loop = asyncio.get_running_loop()
            self._client = aiohttp.ClientSession(
                # The scheduler bounds the streams; the pool only keeps them warm.
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s),
                read_bufsize=READ_BUFSIZE,
                headers=self._headers,
                auto_decompress=False,
            )
        return self._client

    # ------------------------------------------------------------ requests

    def submit(
        self, request: GenerationRequest, *, slot: int, sink: Sink, cancel: CancelEvent
    ) -> Submission:
        loop = asyncio.get_running_loop()
        submission = Submission()
        task = loop.create_task(self._serve(request, sink, cancel, submission))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        cancel.add_callback(lambda: call_soon(loop, task.cancel))
        return submission

    async def _serve(
        self, request: GenerationRequest, sink: Sink, cancel: CancelEvent, submission: Submission
    ) -> None:
        try:
            sink.end(await self._run(request, sink, cancel))
        except asyncio.CancelledError:
            pass  # the client had its done already; the response is closed
        except UpstreamError as exc:
            log.warning(
                "id=%s upstream failed: %s (%s)",
                request.id,
                exc,
                exc.code,
                extra=context(request.conn_id, request.id),
            )
            sink.end(Outcome(reason="error", error_code=exc.code, error_message=str(exc)))
        except Exception:
            log.exception(
                "id=%s backend failed", request.id, extra=context(request.conn_id, request.id)
            )
            sink.end(
                Outcome(reason="error", error_code="internal", error_message="the backend failed")
            )
        finally:
            submission.complete()

    def embeddings(self) -> RelayEmbedDoor:
        """Embedding and rerank requests go to an upstream (:mod:`.openai_embed`)."""
        return self._embed_door

    def pick(
        self, exclude: frozenset[Upstream] = frozenset(), model: str | None = None
    ) -> Upstream | None:
        """The healthy upstream with the fewest requests in flight (first listed
        on a tie) — among those that list ``model``, when routing by model."""
        candidates = [
            u
            for u in self.upstreams
            if u.healthy
            and u not in exclude
            and (model is None or not self._routing or model in u.models)
        ]
        return min(candidates, key=lambda u: u.in_flight, default=None)

    def _target(self, asked: str | None) -> str:
        """The model id to ask for: the one asked, if an upstream lists it."""
        if self._routing and asked is not None and any(asked in u.models for u in self.upstreams):
            return asked
        return self.model

    async def _run(self, request: GenerationRequest, sink: Sink, cancel: CancelEvent) -> Outcome:
        if not self.model:
            self._look_for_a_model()
            raise UpstreamError(
                "no upstream has listed a model at /v1/models yet", code="upstream_unavailable"
            )
        tried: frozenset[Upstream] = frozenset()
        target = self._target(request.model)
        relay = Relay(
            sink,
            cancel,
            TextAssembler(request.stop),
            max_tokens=request.max_tokens,
            clock=asyncio.get_running_loop().time,
        )
        while True:
            upstream = self.pick(tried, target)
            if upstream is None:
                raise UpstreamError(
                    f"no upstream serving {target!r} is reachable (each failed recently "
                    "and is being probed)"
                    if not tried
                    else "no other upstream is reachable",
                    code="upstream_unreachable",
                )
            tried |= {upstream}
            upstream.in_flight += 1
            upstream.requests += 1
            try:
                outcome = await exchange(
                    self._session(),
                    upstream,
                    request,
                    relay,
                    target,
                    first_byte_timeout_s=self.first_byte_timeout_s,
                    silence_timeout_s=self.silence_timeout_s,
                )
            except UpstreamError as exc:
                upstream.errors += 1
                if exc.unhealthy:
                    self._take_out(upstream)
                if exc.retry and not relay.offered and len(tried) == 1 and self.pick(tried, target):
                    log.info(
                        "id=%s retrying on another upstream: %s",
                        request.id,
                        exc.code,
                        extra=context(request.conn_id, request.id),
                    )
                    continue
                raise
            finally:
                upstream.in_flight -= 1
            return outcome

    # ------------------------------------------------------------ health

    def _take_out(self, upstream: Upstream) -> None:
        if upstream.healthy:
            log.warning("upstream %s taken out of rotation", upstream.url)
        upstream.in_rotation.clear()
        upstream.backoff = min(max(upstream.backoff * 2, self.backoff_s), self.max_backoff_s)
        if upstream.probe is None:
            upstream.probe = asyncio.get_running_loop().create_task(self._probe(upstream))

    async def _probe(self, upstream: Upstream) -> None:
        """Wait out the backoff, then ask ``/v1/models`` until it answers."""
        try:
            while True:
                await asyncio.sleep(upstream.backoff)
                if await self._answers(upstream):
                    if self._routing:
                        await self._fetch_listing(upstream)  # what it serves may have changed
                    upstream.in_rotation.set()
                    upstream.backoff = 0.0
                    log.info("upstream %s is back", upstream.url)
                    return
                upstream.backoff = min(upstream.backoff * 2, self.max_backoff_s)
        finally:
            upstream.probe = None

    async def _answers(self, upstream: Upstream) -> bool:
        try:
            async with asyncio.timeout(self.connect_timeout_s + self.silence_timeout_s):
                async with self._session().get(upstream.url + "/models") as response:
                    await response.read()
                    return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    def upstream_stats(self) -> list[UpstreamStats]:
        return [
            UpstreamStats(
                url=u.url,
                in_flight=u.in_flight,
                healthy=u.healthy,
                requests=u.requests,
                errors=u.errors,
                first_byte_seconds_sum=u.first_byte_seconds_sum,
                first_byte_count=u.first_byte_count,
            )
            for u in self.upstreams
        ]

    def unready_reason(self) -> str | None:
        """``/readyz`` is ready while at least one upstream is in rotation
        (and one has listed a model, when none is configured)."""
        if not self.model:
            self._look_for_a_model()
            return "no upstream has listed a model at /v1/models yet"
        if any(u.healthy for u in self.upstreams):
            return None
        return "no upstream is in rotation (each failed and is being probed)"

    def _look_for_a_model(self) -> None:
        if self._discovery is None:
            self._discovery = asyncio.get_running_loop().create_task(self._discover())


def _models_of(listing: object) -> tuple[str, ...]:
    """The model ids of a ``/v1/models`` listing, in order (at least one)."""
    entries = listing["data"]  # type: ignore[index]
    models = tuple(dict.fromkeys(entry["id"] for entry in entries[:1000]))
    if not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError("a listing without models, or a model without an id")
    return models

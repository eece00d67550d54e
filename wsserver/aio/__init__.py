"""The asyncio layer: everything that runs on the event loop or talks to sockets.

As websockets keeps its I/O in ``asyncio/`` around a sans-I/O core, this
package drives the core (:mod:`wsserver.core.protocol`, :mod:`wsserver.core.session`,
:mod:`wsserver.core.pacing`, :mod:`wsserver.security`) and the engine seam
(:mod:`wsserver.backends.base`). Dependencies point one way, top to bottom::

    server        lifecycle, shutdown, the connection table; builds the rest
    ├── listener       the listening socket (a small SO_SNDBUF), the subprotocol
    ├── front          the first request line: /v1, /api, /rerank → the HTTP dialects, the rest → websockets
    ├── http, web      plain HTTP on the same port (HttpContext), the chat page
    ├── connection     the WebSocket protocol's dialect: hello, its frames in and out
    │   ├── pull_requests  its pull requests: progress frames, cancel, the model added
    │   ├── embed_requests its embed requests: one embed_done each, cancel by id
    │   ├── choice_requests its requests for several choices (n): a driver each, one done
    │   └── side_requests  the id book of both: running by id, ids used, the count
    ├── socket_connection  one WebSocket connection, either dialect: receive loop,
    │   │                  frame rate, one table of requests, closing, memory held
    │   ├── sender         messages to the socket, drain-watched
    │   └── peer           the websockets connection class, memory bound
    ├── openai_http    the HTTP/1.1 transport (h11) of the HTTP dialects: reading, timers, close
    │   ├── http_out       its write side: h11 events out, flow control, the drain watch
    │   └── http_router    the one route table (every HTTP API path) and the gate's checks
    │       ├── openai_gate    who may use the API: the handshake's checks, a request rate
    │       ├── openai_routes  the OpenAI API: chat completions, completions, models
    │       ├── responses_http the Responses API over HTTP: POST, GET, DELETE /v1/responses
    │       ├── anthropic_http Anthropic's Messages API: /v1/messages, count_tokens
    │       ├── ollama_http    Ollama's API: /api/chat, /api/generate, embed, the model endpoints
    │       │   └── ollama_pull    one /api/pull's answer: its progress, then success
    │       ├── embedding_routes  /v1/embeddings, /v1/rerank and /rerank
    │       └── exchange       one HTTP exchange, every dialect: model, driver, cancel, the end
    │           ├── choices        n > 1: a driver per choice, their frames merged into one answer
    │           ├── embed_run      an embedding request's engine side: acquire → prepare → embed
    │           ├── http_route     the seam to the routes: Responder, Running, RouteRequest
    │           ├── image_fetch    image URLs fetched before the request runs: allow-list, pinned, capped
    │           └── http_answer    one HTTP answer: streamed (head, keep-alive, drain) or whole
    ├── responses_socket the Responses API's WebSocket mode: lanes, a driver per lane, response.cancel
    ├── responses_run  one response's frames rendered as Responses events (WebSocket mode)
    └── driver         the request driver: a request's way, the same for every dialect
        ├── request_log    a request's last log line (done), every wire
        ├── pipeline       one request's engine side: acquire → submit → pump → finalize
        │   ├── channel        engine → loop bounded queue (the seam's Sink)
        │   └── services       what every request uses (built once by the server)
        │       ├── models         the model registry: a model by name or alias, its slots, figures
        │       │   ├── model          one served model: its engine, queue and state; what it shows
        │       │   └── model_loader   load on demand under the memory budget, unload when idle
        │       │       ├── keep_alive     an idle model's timer: keep_alive, else keep_alive_s
        │       │       └── pulls          downloads from the Hub, one per reference, shared
        │       ├── scheduler      the queue for a model's slots: first come, connections in turn
        │       └── metrics        Prometheus metrics, loop-lag probe
        ├── resume         the resumable requests: detached ones, grace timers, tokens
        └── drain          the one drain watchdog (every dialect's transport uses it)
    upstream_metrics   the openai backend's per-upstream metrics, read at scrape time

Only this package imports websockets, janus and prometheus_client.
"""

from __future__ import annotations

from .server import Server, run

__all__ = ["Server", "run"]

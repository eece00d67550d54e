"""The configuration's shape: one frozen dataclass per section, each key
with its default and its bounds (``_key``); config/default.toml lists them
all, with comments (a test keeps the two equal). Loading, precedence and
validation are :mod:`.load`'s.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MODEL_NAME_RE",
    "MODEL_OVERRIDES",
    "BackendConfig",
    "Config",
    "FakeConfig",
    "ImagesConfig",
    "LimitsConfig",
    "LlamaConfig",
    "LlamaModelConfig",
    "ModelsConfig",
    "OpenAIConfig",
    "SecurityConfig",
    "ServerConfig",
    "StreamConfig",
    "TemplateConfig",
]


def _key(
    default: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    meta = {"low": low, "high": high, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = _key("127.0.0.1")
    port: int = _key(8765, low=0, high=65535)
    #: SO_SNDBUF for accepted sockets, bytes (0 = the kernel's autotuning,
    #: which hides backpressure behind megabytes of buffer).
    sndbuf: int = _key(16384, low=0, high=1 << 26)
    #: websockets write_limit high-water mark, bytes.
    write_limit: int = _key(16384, low=1024, high=1 << 26)
    max_frame_bytes: int = _key(1 << 20, low=1024, high=1 << 28)
    #: Hard ceiling on a connection's unsent output, whatever wrote it (our
    #: frames, websockets' pongs): above it the client is no longer read from,
    #: and aborted if it does not drain within send_timeout_s. At least
    #: write_limit is used.
    max_output_bytes: int = _key(1 << 18, low=1024, high=1 << 28)
    #: Received frames websockets may queue while the receive loop is busy
    #: (each up to max_frame_bytes); above it the client is no longer read from.
    max_queue: int = _key(1, low=1, high=1024)
    #: A send() that makes no progress this long aborts the connection.
    send_timeout_s: float = _key(10.0, low=0.1, high=3600.0)
    #: Close connections that sent nothing and ran nothing this long (0 = never).
    idle_timeout_s: float = _key(600.0, low=0.0, high=86400.0)
    #: An OpenAI API request's head and body must arrive within this long of
    #: its first byte (as a WebSocket handshake must within 10 s); else 408.
    request_timeout_s: float = _key(10.0, low=0.1, high=3600.0)
    #: Requests still running at shutdown get this long to finish.
    shutdown_grace_s: float = _key(5.0, low=0.0, high=3600.0)
    #: After the grace, what the rest of a shutdown may take (farewells, the
    #: engines stopping); past it the process exits anyway, with status 1 and
    #: an error logged (an engine stuck in a native call cannot be stopped).
    shutdown_timeout_s: float = _key(15.0, low=0.1, high=3600.0)
    #: websockets keepalive ping interval (0 = off).
    ping_interval_s: float = _key(20.0, low=0.0, high=3600.0)
    log_level: str = _key("info", choices=("debug", "info", "warning", "error"))
    log_format: str = _key("text", choices=("text", "json"))
    #: How often the event-loop lag probe runs, milliseconds.
    loop_probe_ms: float = _key(100.0, low=1.0, high=60000.0)
    #: While requests wait for the model, log the queue depth this often (0 = never).
    queue_log_s: float = _key(5.0, low=0.0, high=3600.0)


@dataclass(frozen=True, slots=True)
class StreamConfig:
    flush_ms: float = _key(30.0, low=0.0, high=10000.0)
    flush_tokens: int = _key(5, low=1, high=100000)
    queue_tokens: int = _key(64, low=1, high=1 << 20)
    #: A producer blocked by a non-reading client longer than this ends its
    #: request with reason ``error``, code ``stalled`` (0 = wait forever).
    stall_timeout_s: float = _key(5.0, low=0.0, high=86400.0)
    #: Requests are resumable unless they say ``"resumable": false`` (else
    #: only those that say ``true``); docs/protocol.md, "Resuming a stream".
    resumable: bool = _key(False)
    #: A detached resumable request waits this long for its ``resume``.
    resume_grace_s: float = _key(30.0, low=0.0, high=86400.0)
    #: Bytes of sent deltas kept for a replay (0 = derived from the send-side
    #: bounds: max(max_output_bytes, write_limit) + 2 x sndbuf).
    resume_tail_bytes: int = _key(0, low=0, high=1 << 30)
    #: A request's default ``reasoning_format``: ``auto`` sends a think block
    #: as reasoning, apart from the answer; ``none`` leaves it in the text.
    reasoning_format: str = _key("auto", choices=("none", "auto"))
    #: Detached resumable requests kept at once, in total and per client
    #: address group; a request lost beyond them is cancelled (0 = no limit).
    max_detached: int = _key(64, low=0, high=1 << 20)
    max_detached_per_client: int = _key(4, low=0, high=1 << 20)


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_prompt_chars: int = _key(100_000, low=1, high=1 << 26)
    max_messages: int = _key(256, low=1, high=100000)
    max_tokens: int = _key(4096, low=1, high=1 << 20)
    default_max_tokens: int = _key(256, low=1, high=1 << 20)
    #: Memory for the inputs a connection keeps for ``restart`` (the newest is
    #: always kept, whatever its size), bytes.
    restart_memory_bytes: int = _key(1 << 19, low=0, high=1 << 30)
    #: WebSocket protocol: bytes of image uploads (binary frames) a connection
    #: may hold until its next request takes them (0 = no uploads).
    max_upload_bytes: int = _key(20 << 20, low=0, high=1 << 30)
    #: Responses API: bytes of responses kept server-wide for ``previous_response_id``
    #: and ``GET /v1/responses/{id}`` over HTTP (oldest forgotten first; 0 = none kept).
    responses_store_bytes: int = _key(16 << 20, low=0, high=1 << 34)
    #: Responses API: how long a stored HTTP response is kept, seconds.
    responses_store_ttl_s: float = _key(3600.0, low=1.0, high=30 * 86400.0)
    #: Responses API, WebSocket mode: bytes of responses one connection keeps
    #: for ``previous_response_id`` (gone with the connection).
    responses_memory_bytes: int = _key(1 << 20, low=0, high=1 << 30)
    #: Open WebSocket connections in total; more are refused with 503 (0 = no limit).
    max_connections: int = _key(256, low=0, high=1 << 20)
    #: Open WebSocket connections per client IP; more are refused with 429 (0 = no limit).
    max_connections_per_ip: int = _key(64, low=0, high=1 << 20)
    #: Sustained client frames per second per connection (token bucket; 0 = no limit).
    frames_per_s: float = _key(100.0, low=0.0, high=1e6)
    #: Bucket size: frames a client may send in a burst.
    frames_burst: int = _key(200, low=1, high=1 << 20)
    #: This many rate-limited frames within 10 s close the connection with 1008.
    flood_close_after: int = _key(100, low=1, high=1 << 20)


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    #: Shared secret; "" = no authentication. Prefer WSSERVER_SECURITY_AUTH_TOKEN.
    auth_token: str = _key("")
    #: Accept WebSocket handshakes without an Origin header (non-browser clients).
    allow_missing_origin: bool = _key(True)
    #: Origins accepted besides the server's own and loopback ones ("*" = any).
    allowed_origins: list[str] = _key([])  # noqa: RUF009 - a default_factory
    #: Host names accepted in the Host header besides IP literals, localhost and server.host.
    allowed_hosts: list[str] = _key([])  # noqa: RUF009 - a default_factory


@dataclass(frozen=True, slots=True)
class ImagesConfig:
    """Fetching http(s) image URLs on a client's behalf (docs/images.md, "Fetching")."""

    #: Hosts whose image URLs the server fetches: ``host``, ``*.example.com``
    #: (any name under it, not itself), each with an optional ``:port`` (without
    #: one, only the scheme's default port). Empty: nothing is fetched.
    fetch_hosts: list[str] = _key([])  # noqa: RUF009 - a default_factory
    #: Plain ``http://`` URLs too (else ``https://`` only).
    fetch_http: bool = _key(False)
    #: Hosts that resolve to private, loopback, link-local, shared or reserved
    #: addresses (else refused whatever the allow-list says).
    fetch_private: bool = _key(False)
    #: The most bytes one fetched image may have (the request's images together:
    #: 20 MiB, whatever this says).
    fetch_max_bytes: int = _key(20 << 20, low=1, high=20 << 20)
    #: One image's fetch, from resolving its name to its last byte.
    fetch_timeout_s: float = _key(10.0, low=0.01, high=600.0)


@dataclass(frozen=True, slots=True)
class FakeConfig:
    tokens_per_s: float = _key(50.0, low=0.0, high=1e7)
    prefill_ms_per_token: float = _key(0.0, low=0.0, high=10000.0)
    parallel: int = _key(0, low=0, high=100000)
    max_waiting: int = _key(64, low=0, high=100000)
    #: Stream this UTF-8 file instead of random words ("" = random words).
    text_file: str = _key("")
    #: Stream each request's prompt (a chat's last user message) back.
    echo: bool = _key(False)
    #: More names requests may give for its model ("fake").
    aliases: list[str] = _key([])  # noqa: RUF009 - a default_factory


@dataclass(frozen=True, slots=True)
class LlamaModelConfig:
    """One ``[[backend.llama.models]]`` table: a model the server may serve.

    ``overrides`` holds the ``[backend.llama]`` settings this model sets
    differently (validated like those keys); :meth:`settings` applies them.
    """

    name: str
    #: The GGUF file ("" = the default model's package).
    model: str
    overrides: tuple[tuple[str, Any], ...] = ()
    #: Load it when the server starts rather than on its first request.
    preload: bool = False
    #: More names requests may give for it (clients that hard-code a name).
    aliases: tuple[str, ...] = ()

    def settings(self, base: LlamaConfig) -> LlamaConfig:
        """``base`` with this model's file and overrides (not the default's aliases)."""
        own: dict[str, Any] = {"mmproj": "", **dict(self.overrides)}
        return dataclasses.replace(base, model=self.model, models=(), aliases=[], **own)


#: The ``[backend.llama]`` settings a ``[[backend.llama.models]]`` table may override.
MODEL_OVERRIDES = (
    "mmproj",
    "n_ctx",
    "n_threads",
    "n_batch",
    "prefill_chunk",
    "prefill_budget",
    "prefill_gap_ms",
    "parallel",
    "max_waiting",
    "chat_template_file",
    "keep_alive_s",
    "n_ubatch",
    "n_gpu_layers",
    "flash_attn",
    "cache_type_k",
    "cache_type_v",
    "use_mmap",
    "use_mlock",
    "grammar_deadline_ms",
    "engine_stall_s",
    "embed_batch",
    "prompt_cache_bytes",
    "speculative",
    "draft_max",
    "draft_ngram",
)
#: What a model's name (and an alias) may be.
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+/-]{0,127}")


@dataclass(frozen=True, slots=True)
class TemplateConfig:
    """``[backend.llama.template]``: what a model's chat template (code from a
    downloaded file) may take. Compiled and rendered in worker processes, never
    in the server's (docs/operations.md, "Chat template bounds")."""

    #: Wall-clock seconds one compile (with its load-time probe) or one render
    #: may last; then its worker is killed (at load: the load fails; per
    #: request: a 400 naming it).
    timeout_s: float = _key(2.0, low=0.01, high=3600.0)
    #: A worker's address space (RLIMIT_AS), the interpreter's ~30 MiB included.
    memory_bytes: int = _key(256 << 20, low=64 << 20, high=1 << 40)
    #: Worker processes per model (each ~25 MB resident while idle); a render
    #: waits at most timeout_s for a free one, then is refused as overloaded.
    workers: int = _key(2, low=1, high=64)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    model: str = _key("")
    #: The model's vision projector GGUF ("" = none: text only; docs/images.md).
    #: Not inherited by ``[[backend.llama.models]]``: each model names its own.
    mmproj: str = _key("")
    #: More names requests may give for the default model (clients that
    #: hard-code one, e.g. "gpt-4o"); each model's table has its own.
    aliases: list[str] = _key([])  # noqa: RUF009 - a default_factory
    n_ctx: int = _key(4096, low=16, high=1 << 20)
    n_threads: int = _key(0, low=0, high=1024)
    n_batch: int = _key(512, low=1, high=1 << 16)
    #: Tokens llama.cpp computes in one micro-batch (0 = n_batch).
    n_ubatch: int = _key(0, low=0, high=1 << 16)
    #: Layers offloaded to the GPU (with a GPU build of llama.cpp; -1 = all).
    n_gpu_layers: int = _key(0, low=-1, high=1 << 20)
    #: Flash attention: "on", "off", or "auto" (llama.cpp decides per device).
    flash_attn: str = _key("auto", choices=("auto", "on", "off"))
    #: KV cache element types (llama-server's --cache-type-k/-v); a quantized
    #: V cache needs flash attention.
    cache_type_k: str = _key("f16", choices=("f16", "q8_0", "q4_0"))
    cache_type_v: str = _key("f16", choices=("f16", "q8_0", "q4_0"))
    #: Map the GGUF into memory rather than read it (false: read, as --no-mmap).
    use_mmap: bool = _key(True)
    #: Lock the weights in RAM (no swapping; may need a raised RLIMIT_MEMLOCK).
    use_mlock: bool = _key(False)
    #: The freeze bound: while other sequences decode, a step carrying prompt
    #: tokens (or an image's or embedding inputs' work) lasts at most this long
    #: (ms) — their worst pause; the prompt gets the rest of the step.
    prefill_gap_ms: float = _key(200.0, low=0.0, high=10000.0)
    #: ... or this many times their decode-only step, when that is longer (many
    #: streams, a slow machine: the prompt must still move).
    prefill_budget: float = _key(2.0, low=0.0, high=1000.0)
    #: Prompt tokens per step while others decode when both of the above are 0.
    prefill_chunk: int = _key(64, low=1, high=1 << 16)
    parallel: int = _key(4, low=1, high=64)
    max_waiting: int = _key(64, low=0, high=100000)
    #: A Jinja chat template file that replaces the model's own ("" = the model's).
    chat_template_file: str = _key("")
    #: A grammar-constrained request whose grammar work for one token takes
    #: longer ends with ``unsupported_option`` (its native call is given up on;
    #: docs/operations.md, "Grammar and schema bounds").
    grammar_deadline_ms: float = _key(1000.0, low=10.0, high=600000.0)
    #: An engine step running this long (work pending, nothing finished) makes
    #: /readyz 503, sets wsserver_model_engine_stalled and logs an error once
    #: (0 = never).
    engine_stall_s: float = _key(30.0, low=0.0, high=86400.0)
    #: Embeddings and rerank (docs/embeddings.md): the longest input, in
    #: tokens, and the most one embedding decode holds — the size of the
    #: model's embedding context, made on its first embedding request (0 =
    #: this model serves no embeddings).
    embed_batch: int = _key(512, low=0, high=1 << 16)
    #: Host memory for the prompt states of conversations beyond the slots
    #: (a returning one is restored, not prefilled again), bytes; counted in
    #: ``models_memory_bytes``. -1 = the size of the model's KV cache; 0 = none.
    prompt_cache_bytes: int = _key(-1, low=-1, high=1 << 50)
    #: Speculative decoding with n-gram drafts from a sequence's own prompt
    #: and output (docs/llama.md, "Speculative decoding"): "auto" (the default)
    #: drafts where a long n-gram matched and backs off where drafts are
    #: rejected; "off" never.
    speculative: str = _key("auto", choices=("auto", "off"))
    #: The most draft tokens a sequence decodes in one step (the batch has room for them).
    draft_max: int = _key(32, low=1, high=256)
    #: The shortest match of a sequence's last tokens that drafts (12 is looked up first).
    draft_ngram: int = _key(8, low=2, high=12)
    #: More models, each a ``[[backend.llama.models]]`` table (docs/operations.md).
    models: tuple[LlamaModelConfig, ...] = _key(())
    #: A directory whose ``*.gguf`` files are models too, named by file stem ("" = none).
    models_dir: str = _key("")
    #: Bytes the loaded models (weights + KV cache) may take together; a load
    #: unloads idle models, least recently used first, to fit (0 = 3/4 of the
    #: machine's memory).
    models_memory_bytes: int = _key(0, low=0, high=1 << 50)
    #: A model without requests this long is unloaded (0 = kept until its
    #: memory is needed).
    keep_alive_s: float = _key(0.0, low=0.0, high=365 * 86400.0)
    #: Bounds on the chat template's compile and renders.
    template: TemplateConfig = field(default_factory=TemplateConfig)


@dataclass(frozen=True, slots=True)
class OpenAIConfig:
    """An OpenAI-compatible upstream (llama-server, vLLM, SGLang, Ollama, LM Studio)."""

    #: Base URLs, each ending in /v1; requests go to the healthy one with the fewest in flight.
    urls: list[str] = _key(["http://127.0.0.1:8080/v1"])  # noqa: RUF009 - a default_factory
    #: Sent as "Authorization: Bearer …" ("" = none). Prefer WSSERVER_BACKEND_OPENAI_API_KEY.
    api_key: str = _key("")
    #: The model to ask every upstream for ("" = route each request by its
    #: model to an upstream that lists it at /v1/models; none asked: the first listed).
    model: str = _key("")
    #: More names requests may give for ``model`` (only with a configured ``model``).
    aliases: list[str] = _key([])  # noqa: RUF009 - a default_factory
    #: Requests at once per upstream; more wait their turn.
    parallel: int = _key(4, low=1, high=4096)
    max_waiting: int = _key(64, low=0, high=100000)
    #: Opening the TCP (and TLS) connection to an upstream.
    connect_timeout_s: float = _key(5.0, low=0.01, high=3600.0)
    #: From sending the request to the first byte of the streamed body (prefill included).
    first_byte_timeout_s: float = _key(120.0, low=0.01, high=86400.0)
    #: Longest silence between two chunks of a stream.
    silence_timeout_s: float = _key(30.0, low=0.01, high=86400.0)


@dataclass(frozen=True, slots=True)
class ModelsConfig:
    """Models by name: pulling GGUFs from the Hugging Face Hub (docs/models.md)."""

    #: Let API clients (the WebSocket ``pull`` request, the page) download
    #: models; needs ``security.auth_token``. The ``wsserver pull`` command and
    #: ``hf:`` references in the configuration are the operator's and always pull.
    allow_pull: bool = _key(False)
    #: The largest pull, every file of it together, bytes (0 = no limit).
    max_download_bytes: int = _key(64 << 30, low=0, high=1 << 50)
    #: The Hub's address ("" = https://huggingface.co; HF_ENDPOINT sets it too).
    endpoint: str = _key("")
    #: The Hub's cache, where pulled files go ("" = HF_HUB_CACHE, else
    #: HF_HOME/hub, else ~/.cache/huggingface/hub: shared with other tools).
    cache_dir: str = _key("")
    #: Never ask the Hub; only cached files (HF_HUB_OFFLINE=1 sets it too).
    offline: bool = _key(False)


@dataclass(frozen=True, slots=True)
class BackendConfig:
    kind: str = _key("llama", choices=("fake", "llama", "openai"))
    fake: FakeConfig = field(default_factory=FakeConfig)
    llama: LlamaConfig = field(default_factory=LlamaConfig)
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)

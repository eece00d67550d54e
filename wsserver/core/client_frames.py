"""Wire protocol v1, client to server: the frames a client sends, parsed and validated.

Sans-I/O: text in, frozen dataclasses out. :mod:`wsserver.core.protocol` re-exports
every public name here (import them from there); the frames the server sends
are described in that module. docs/protocol.md is the specification and
docs/protocol.schema.json its machine-checkable form.

A user message's ``images`` (base64, or uploads sent in binary frames) are
read into bytes by :mod:`wsserver.core.frame_images`, checked as every wire's.

Parsing is strict. Every way a frame can be wrong maps to a
:class:`~wsserver.errors.ProtocolError` with a wire code, so the connection
layer only has to turn that error into an ``error`` frame and carry on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final

import orjson

from ..errors import ProtocolError, PullError
from ..pull.reference import Reference, parse_reference
from .chat_input import (
    Message,
    ToolCall,
    parse_messages,
    parse_template_kwargs,
    parse_tool_choice,
    parse_tools,
)
from .embedding import EmbedInput, EmbedInputError, parse_inputs
from .fields import (
    ID_PATTERN,
    ID_RE,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    check_keys,
    is_int,
    parse_float,
    parse_id,
    parse_ints,
    parse_keep_alive,
    parse_stop,
    parse_string,
    parse_word,
)
from .frame_images import FrameImages
from .image_check import ImageBudget
from .sampling import (
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    SAMPLING_FIELDS,
    STRUCTURE_FIELDS,
    LogitBias,
    parse_sampling_fields,
)
from .uploads import Pending, Uploads

__all__ = [
    "ID_PATTERN",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOKEN_CHARS",
    "Cancel",
    "ClientFrame",
    "EmbedFrame",
    "Generate",
    "Limits",
    "Message",
    "Pull",
    "Restart",
    "Resume",
    "ToolCall",
    "parse_client_frame",
]

#: The longest model name a request may give (names are configured; longer ones cannot exist).
MAX_MODEL_CHARS: Final = 128
#: The longest ``resume_token`` accepted (the server issues 32 characters).
MAX_TOKEN_CHARS: Final = 128


@dataclass(frozen=True, slots=True)
class Limits:
    """What a connection may ask for. Sent to the client in ``hello``."""

    max_frame_bytes: int = 1 << 20
    max_prompt_chars: int = 100_000
    max_messages: int = 256
    max_tokens: int = 4096
    default_max_tokens: int = 256
    #: Bytes of image uploads (binary frames) a connection may hold until
    #: its next request takes them; 0: none taken (and what a client reads
    #: from a server before uploads, which does not say it).
    max_upload_bytes: int = 0

    def to_wire(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class Generate:
    """Start a request. Exactly one of ``prompt`` and ``messages`` is set."""

    id: str
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: Keep the request through a lost connection (``None``: the server's
    #: ``stream.resumable`` default decides).
    resumable: bool | None = None
    # The rest of the sampler chain (wsserver.core.sampling); None = not given.
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: LogitBias | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    #: A GBNF grammar the output must match, or a JSON Schema (as JSON text)
    #: it must validate against; at most one of them.
    grammar: str | None = None
    json_schema: str | None = None
    #: OpenAI's function tools and extra chat-template variables, as JSON
    #: text (wsserver.core.chat_input); only with ``messages``.
    tools: str | None = None
    chat_template_kwargs: str | None = None
    #: OpenAI's ``tool_choice``: ``auto`` | ``none`` | ``required``, and for
    #: a named function ``required`` with its name in ``tool_name``.
    tool_choice: str | None = None
    tool_name: str | None = None
    #: At most one call per turn when False (wsserver.shaping.tool_calls).
    parallel_tool_calls: bool | None = None
    #: ``none`` | ``auto`` (wsserver.shaping.reasoning); None: the server's default.
    reasoning_format: str | None = None
    #: At most this many tokens inside the think block, then the engine
    #: closes it and the model answers (llama-server's per-request
    #: ``reasoning_budget_tokens``; 0: close it at once). None: no budget.
    reasoning_budget_tokens: int | None = None
    #: Report each generated token's log-probability (``delta.logprobs``),
    #: with ``top_logprobs`` alternatives (0 to 20; only with ``logprobs``).
    logprobs: bool | None = None
    top_logprobs: int | None = None
    #: The model to serve it (one of ``hello.models``); None: the default.
    #: The server fills in the one it chose before the request is accepted.
    model: str | None = None
    #: Seconds its model stays loaded once idle after this request (Ollama's
    #: ``keep_alive``): 0 = unloaded at once, -1 = until its memory is needed;
    #: None: the model's ``keep_alive_s``.
    keep_alive: float | None = None
    #: ``auto`` | ``off``: n-gram drafts where they pay, or none for this
    #: request (for speed only: speculation never changes the output). None: ``auto``.
    speculative: str | None = None
    #: Choices asked for (``n``), the one this frame runs, the request's own id.
    n: int = 1
    choice: int = 0
    choice_of: str = ""


@dataclass(frozen=True, slots=True)
class Cancel:
    id: str
    #: Cancel a *detached* resumable request from any connection that knows
    #: its token (the request id alone is not a credential).
    resume_token: str | None = None


@dataclass(frozen=True, slots=True)
class Resume:
    """Pick up a detached resumable request on this connection: replay the
    deltas after ``after_seq`` (-1: none arrived), then go on live."""

    id: str
    resume_token: str
    after_seq: int


@dataclass(frozen=True, slots=True)
class Restart:
    """Cancel ``id`` if it runs, then run ``new_id`` with its input.

    ``overrides`` holds the generate fields the frame gave, already validated,
    keyed by :class:`Generate` attribute name.
    """

    id: str
    new_id: str
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, old: Generate) -> Generate:
        """The request ``new_id`` runs: ``old``'s input with the overrides."""
        changes = dict(self.overrides)
        # A new constraint replaces the old one, whichever kind it was.
        if "grammar" in changes:
            changes.setdefault("json_schema", None)
        elif "json_schema" in changes:
            changes.setdefault("grammar", None)
        if "prompt" in changes:
            changes["messages"] = None
        elif "messages" in changes:
            changes["prompt"] = None
        return replace(old, id=self.new_id, **changes)


@dataclass(frozen=True, slots=True)
class Pull:
    """Download a model from the Hugging Face Hub and serve it (docs/models.md):
    ``pull_progress`` frames, then exactly one ``pull_done``; ``cancel`` by id."""

    id: str
    #: What to pull, parsed strictly (``org/repo:Q4_K_M``, ``org/repo/file.gguf``, ``@rev``).
    model: Reference


@dataclass(frozen=True, slots=True)
class EmbedFrame:
    """Vectors for inputs (docs/embeddings.md, "Over the WebSocket"): exactly
    one ``embed_done``; ``cancel`` by id. Runs beside the connection's
    generations, in its model's queue and engine."""

    id: str
    #: OpenAI's ``input`` shapes, checked (:func:`~wsserver.core.embedding.parse_inputs`).
    inputs: tuple[EmbedInput, ...]
    model: str | None = None
    #: How ``embed_done`` carries the vectors: ``float`` lists or ``base64``.
    encoding: str = "float"


ClientFrame = Generate | Cancel | Restart | Resume | Pull | EmbedFrame


# ---------------------------------------------------------------- parsing


def parse_client_frame(
    data: str | bytes, limits: Limits, uploads: Uploads | None = None
) -> ClientFrame:
    """Parse one WebSocket text message into a client frame.

    Raises :class:`ProtocolError` for anything that is not a valid v1 frame.
    The error carries the frame's ``id`` when one could be read, so that the
    client can tell which of its requests was refused. A ``generate`` or
    ``restart`` takes every one of ``uploads`` (the connection's binary
    frames: :mod:`wsserver.core.uploads`), accepted or refused.
    """
    if isinstance(data, bytes):
        raise ProtocolError(
            "bad_json", "binary frames are image uploads only; send JSON text frames"
        )
    if len(data) > limits.max_frame_bytes:
        # The transport enforces the byte limit; this guards direct callers.
        raise ProtocolError("too_large", f"frame exceeds {limits.max_frame_bytes} bytes")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("bad_json", f"invalid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", "a frame must be a JSON object")
    raw_id = obj.get("id")
    request_id = raw_id if isinstance(raw_id, str) and ID_RE.fullmatch(raw_id) else None
    kind = obj.get("type")
    try:
        if kind in ("generate", "restart"):
            # Taken whatever becomes of the frame: an upload lives until the
            # next request, never longer (wsserver.core.uploads).
            pending = uploads.take() if uploads is not None else None
            if kind == "generate":
                return _parse_generate(obj, limits, pending)
            return _parse_restart(obj, limits, pending)
        if kind == "cancel":
            check_keys(obj, {"type", "id", "resume_token"})
            token = _parse_token(obj) if "resume_token" in obj else None
            return Cancel(id=parse_id(obj, "id"), resume_token=token)
        if kind == "resume":
            return _parse_resume(obj)
        if kind == "pull":
            return _parse_pull(obj)
        if kind == "embed":
            return _parse_embed(obj)
    except ProtocolError as exc:
        if exc.request_id is None:
            exc.request_id = request_id
        raise
    if not isinstance(kind, str):
        raise ProtocolError("bad_request", "missing or non-string field 'type'", request_id)
    raise ProtocolError("unknown_type", f"unknown frame type {kind[:40]!r}", request_id)


_GENERATE_FIELDS: Final = frozenset(
    {
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "resumable",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "reasoning_format",
        "reasoning_budget_tokens",
        "logprobs",
        "top_logprobs",
        "model",
        "keep_alive",
        "speculative",
        "n",
        *SAMPLING_FIELDS,
        *STRUCTURE_FIELDS,
    }
)


def _parse_generate(obj: dict[str, Any], limits: Limits, pending: Pending | None) -> Generate:
    check_keys(obj, {"type", "id"} | _GENERATE_FIELDS)
    request_id = parse_id(obj, "id")
    options = _parse_generate_fields(obj, limits, request_id, pending)
    has_prompt = "prompt" in options
    has_messages = "messages" in options
    if has_prompt == has_messages:
        raise ProtocolError(
            "bad_request", "give exactly one of 'prompt' and 'messages'", request_id
        )
    for name in ("tools", "chat_template_kwargs", "reasoning_budget_tokens"):
        if has_prompt and options.get(name) is not None:
            raise ProtocolError(
                "bad_request", f"'{name}' needs 'messages', not 'prompt'", request_id
            )
    if "top_logprobs" in options and options.get("logprobs") is not True:
        raise ProtocolError("bad_request", "'top_logprobs' needs 'logprobs': true", request_id)
    return Generate(id=request_id, **options)


def _parse_restart(obj: dict[str, Any], limits: Limits, pending: Pending | None) -> Restart:
    check_keys(obj, {"type", "id", "new_id"} | _GENERATE_FIELDS)
    old_id = parse_id(obj, "id")
    new_id = parse_id(obj, "new_id")
    options = _parse_generate_fields(obj, limits, new_id, pending)
    if "prompt" in options and "messages" in options:
        raise ProtocolError("bad_request", "give at most one of 'prompt' and 'messages'", new_id)
    return Restart(id=old_id, new_id=new_id, overrides=options)


#: The generate fields that are integers within bounds (``top_k`` 0: no limit).
_INT_FIELDS = {
    **{"top_k": (0, 2**31 - 1), "top_logprobs": (0, MAX_TOP_LOGPROBS)},
    **{"n": (1, MAX_CHOICES), "seed": (0, 2**32 - 1)},
}


def _parse_generate_fields(
    obj: dict[str, Any], limits: Limits, request_id: str, pending: Pending | None = None
) -> dict[str, Any]:
    """Validate the optional generate fields present in ``obj`` (a user
    message's ``images`` read from the frame or ``pending`` uploads)."""
    out: dict[str, Any] = {}

    def fail(message: str) -> ProtocolError:
        return ProtocolError("bad_request", message, request_id)

    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise fail("'prompt' must be a string")
        if len(prompt) > limits.max_prompt_chars:
            raise ProtocolError(
                "too_large", f"'prompt' exceeds {limits.max_prompt_chars} characters", request_id
            )
        out["prompt"] = prompt
    if "messages" in obj:
        out["messages"] = parse_messages(
            obj["messages"],
            max_messages=limits.max_messages,
            fail=fail,
            images=FrameImages(ImageBudget(fail), pending),
        )
    if "tools" in obj:
        out["tools"] = parse_tools(obj["tools"], fail)
    out.update(parse_tool_choice(obj, out.get("tools"), fail))
    if "reasoning_format" in obj:
        if obj["reasoning_format"] not in ("none", "auto"):
            raise fail('\'reasoning_format\' must be "none" or "auto"')
        out["reasoning_format"] = obj["reasoning_format"]
    if "reasoning_budget_tokens" in obj:
        value = obj["reasoning_budget_tokens"]
        if not is_int(value) or value < -1:
            raise fail("'reasoning_budget_tokens' must be an integer >= 0 (-1: no budget)")
        # -1 is llama-server's "unrestricted": the same as leaving it out.
        out["reasoning_budget_tokens"] = None if value == -1 else value
    out.update(parse_word(obj, "speculative", ("auto", "off"), fail))
    if "chat_template_kwargs" in obj:
        out["chat_template_kwargs"] = parse_template_kwargs(obj["chat_template_kwargs"], fail)
    chat_chars = sum(m.size() for m in out.get("messages", ())) + len(out.get("tools", ""))
    if chat_chars > limits.max_prompt_chars:
        raise ProtocolError(
            "too_large",
            f"'messages' and 'tools' exceed {limits.max_prompt_chars} characters",
            request_id,
        )
    if "max_tokens" in obj:
        value = obj["max_tokens"]
        if not is_int(value) or value < 1:
            raise fail("'max_tokens' must be an integer >= 1")
        if value > limits.max_tokens:
            raise fail(f"'max_tokens' exceeds the limit of {limits.max_tokens}")
        out["max_tokens"] = value
    if "temperature" in obj:
        out["temperature"] = parse_float(obj["temperature"], "temperature", 0.0, 100.0, fail)
    if "top_p" in obj:
        out["top_p"] = parse_float(obj["top_p"], "top_p", 0.0, 1.0, fail)
    if "stop" in obj:
        out["stop"] = parse_stop(obj["stop"], fail)
    for name in ("resumable", "logprobs"):
        if name in obj:
            if not isinstance(obj[name], bool):
                raise fail(f"'{name}' must be true or false")
            out[name] = obj[name]
    out.update(parse_ints(obj, _INT_FIELDS, fail))
    out.update(parse_string(obj, "model", MAX_MODEL_CHARS, fail))
    if "keep_alive" in obj:
        out["keep_alive"] = parse_keep_alive(obj["keep_alive"], fail)
    out.update(parse_sampling_fields(obj, fail, limits.max_prompt_chars))
    return out


def _parse_resume(obj: dict[str, Any]) -> Resume:
    check_keys(obj, {"type", "id", "resume_token", "after_seq"})
    request_id = parse_id(obj, "id")
    token = _parse_token(obj)
    after_seq: Any = obj.get("after_seq")
    if not is_int(after_seq) or after_seq < -1:
        raise ProtocolError(
            "bad_request", "'after_seq' must be an integer >= -1 (-1: no delta arrived)"
        )
    return Resume(id=request_id, resume_token=token, after_seq=after_seq)


def _parse_embed(obj: dict[str, Any]) -> EmbedFrame:
    check_keys(obj, {"type", "id", "input", "model", "encoding_format"})
    request_id = parse_id(obj, "id")
    if "input" not in obj:
        raise ProtocolError("bad_request", "missing field 'input'", request_id)
    try:
        inputs = parse_inputs(obj["input"])
    except EmbedInputError as exc:
        raise ProtocolError("bad_request", str(exc), request_id) from None
    model = obj.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ProtocolError("bad_request", "'model' must be a non-empty string", request_id)
    encoding = obj.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ProtocolError(
            "bad_request", '\'encoding_format\' must be "float" or "base64"', request_id
        )
    return EmbedFrame(id=request_id, inputs=inputs, model=model, encoding=encoding)


def _parse_pull(obj: dict[str, Any]) -> Pull:
    check_keys(obj, {"type", "id", "model"})
    request_id = parse_id(obj, "id")
    value = obj.get("model")
    if not isinstance(value, str):
        raise ProtocolError(
            "bad_request", "'model' must be a string: org/repo[:QUANT] or org/repo/file.gguf"
        )
    try:
        return Pull(id=request_id, model=parse_reference(value))
    except PullError as exc:
        raise ProtocolError(exc.code, exc.message, request_id) from None


def _parse_token(obj: dict[str, Any]) -> str:
    value = obj.get("resume_token")
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_TOKEN_CHARS:
        raise ProtocolError(
            "bad_request", f"'resume_token' must be a string of 1 to {MAX_TOKEN_CHARS} characters"
        )
    return value

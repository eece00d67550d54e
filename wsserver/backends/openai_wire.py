"""What the openai backend sends and reads, without the I/O (sans-I/O).

A request becomes the JSON body of ``/v1/completions`` (a ``prompt``) or
``/v1/chat/completions`` (``messages``), always streamed, with
``stream_options.include_usage`` so that the last chunk carries the
upstream's own token counts. Each ``data:`` event of the response is one
:class:`Chunk`: the text it adds, the finish reason if it ends the choice,
the usage if it has one (and llama-server's ``timings``); ``[DONE]`` ends
the stream.

Failures carry their wire code (:class:`UpstreamError`) and say whether
another upstream could still serve the request (``retry``: nothing reached
the client yet and the fault was the upstream's, not the request's) and
whether the upstream itself looks broken (``unhealthy``: take it out of
rotation until a probe answers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import orjson

from ..core.logprobs import LOGPROB_FLOOR, MAX_ENTRY_BYTES, TokenLogprob, parse_entries
from ..core.protocol import DoneReason
from ..core.sampling import MAX_TOP_LOGPROBS, SAMPLING_FIELDS, Sampling
from ..errors import BackendError, WireCode
from .base import GenerationRequest

__all__ = [
    "UPSTREAM_TIMINGS",
    "Chunk",
    "ToolDelta",
    "UpstreamError",
    "error_message",
    "parse_chunk",
    "request_body",
    "sampler_options",
]

#: Longest upstream error message passed on to the client, in characters.
MAX_MESSAGE = 500


class UpstreamError(BackendError):
    """The upstream failed this request; ``code`` says how."""

    def __init__(
        self, message: str, *, code: WireCode, retry: bool = False, unhealthy: bool = False
    ) -> None:
        super().__init__(message, code=code)
        #: Another upstream may take the request (nothing was sent to the client).
        self.retry = retry
        #: Take the upstream out of rotation until a probe answers.
        self.unhealthy = unhealthy


def request_body(request: GenerationRequest, model: str) -> tuple[str, bytes]:
    """The path (below ``/v1``) and JSON body for ``request``."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        # Not in OpenAI's own API; llama-server, vLLM, SGLang, Ollama and
        # llama_cpp.server take it, and the others ignore an unknown field.
        "top_k": request.top_k,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    body.update(sampler_options(request.sampling))
    if request.logprobs is not None:
        if request.messages is not None:
            body["logprobs"] = True
            body["top_logprobs"] = request.logprobs
        else:
            body["logprobs"] = request.logprobs  # the legacy count
    if request.stop:
        body["stop"] = list(request.stop)
    if request.grammar is not None:
        body["grammar"] = request.grammar  # llama-server's extension
    if request.messages is not None:
        body["messages"] = [m.to_openai() for m in request.messages]
        if request.tools is not None:
            body["tools"] = orjson.loads(request.tools)
            if request.tool_choice == "required":
                body["tool_choice"] = (
                    {"type": "function", "function": {"name": request.tool_name}}
                    if request.tool_name is not None
                    else "required"
                )
            if request.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = request.parallel_tool_calls
        if request.reasoning_budget is not None:
            # llama-server's per-request budget (its --reasoning-budget for one
            # request): the upstream must honour it (docs/upstream.md).
            body["reasoning_budget_tokens"] = request.reasoning_budget
        if request.chat_template_kwargs is not None:
            # llama-server's extension (vLLM and SGLang take it too).
            body["chat_template_kwargs"] = orjson.loads(request.chat_template_kwargs)
        if request.json_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": orjson.loads(request.json_schema)},
            }
        return "/chat/completions", orjson.dumps(body)
    if request.json_schema is not None:
        body["json_schema"] = orjson.loads(request.json_schema)  # llama-server's extension
    body["prompt"] = request.prompt or ""
    return "/completions", orjson.dumps(body)


_DEFAULTS = Sampling()


def sampler_options(sampling: Sampling) -> dict[str, Any]:
    """The sampler options a request gave other than the defaults, by their
    llama-server names (OpenAI's own for the penalties and ``logit_bias``).

    Defaults are left out: an upstream that is not llama-server keeps its own
    and is not sent names it may refuse. ``logit_bias`` goes as OpenAI's
    object (llama-server also takes text keys there, and ``false``: a ban).
    """
    out: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = getattr(sampling, name)
        if value == getattr(_DEFAULTS, name):
            continue
        if name == "logit_bias":
            value = {str(token): False if bias == -math.inf else bias for token, bias in value}
        elif name == "dry_sequence_breakers":
            value = list(value)
        out[name] = value
    return out


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed event's contribution."""

    text: str = ""
    #: The choice ended: ``stop`` or ``length`` (anything else counts as ``stop``).
    finish: DoneReason | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: llama-server's own ``timings`` object (its last chunk has one), known keys only.
    timings: dict[str, float] | None = None
    #: The stop string the upstream stopped at, when it says (vLLM's ``stop_reason``).
    stop_string: str | None = None
    #: The tokens' log-probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()
    #: ``usage.prompt_tokens_details.cached_tokens``: the upstream's prefix cache.
    cached_tokens: int | None = None
    #: The model's reasoning the upstream split off (``delta.reasoning_content``,
    #: or ``delta.reasoning`` as vLLM and Ollama name it).
    reasoning: str = ""
    #: ``delta.tool_calls`` parts: (index, id, name, arguments), any but index may be None/"".
    tool_calls: tuple[ToolDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """One part of a streamed tool call, as OpenAI's ``delta.tool_calls[i]``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


#: The figures of llama-server's ``timings`` passed on in ``done.upstream_timings``:
#: token counts (``*_n``; ``cache_n`` = prompt tokens reused from its cache,
#: ``draft_*`` with speculative decoding), milliseconds and rates. Anything else in the object is dropped, so the wire
#: stays what docs/protocol.schema.json says whatever the upstream's version.
UPSTREAM_TIMINGS = (
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
    "draft_n",
    "draft_n_accepted",
)


def _bad(message: str) -> UpstreamError:
    return UpstreamError(message, code="upstream_bad_stream")


def parse_chunk(data: str) -> Chunk:
    """One ``data:`` payload (not ``[DONE]``) of a completion or chat stream."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _bad("the upstream sent an event that is not JSON") from None
    if not isinstance(obj, dict):
        raise _bad("the upstream sent an event that is not a JSON object")
    if "error" in obj:
        # Some servers report a failure mid-stream as an event of its own.
        raise UpstreamError(
            "the upstream failed mid-stream: " + _message_of(obj["error"]),
            code="upstream_failed",
        )
    choices = obj.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list):
        raise _bad("the upstream sent an event whose choices are not a list")
    text = reasoning = ""
    calls: list[ToolDelta] = []
    finish: DoneReason | None = None
    stop_string: str | None = None
    entries: list[TokenLogprob] = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise _bad("the upstream sent a choice that is not an object")
        piece: Any
        delta = choice.get("delta")
        if delta is not None:  # chat
            if not isinstance(delta, dict):
                raise _bad("the upstream sent a delta that is not an object")
            piece = delta.get("content")
            reasoning += _reasoning(delta)
            calls.extend(_tool_deltas(delta.get("tool_calls")))
        else:  # completion
            piece = choice.get("text")
        if piece is not None:
            if not isinstance(piece, str):
                raise _bad("the upstream sent text that is not a string")
            text += piece
        reason = choice.get("finish_reason")
        if reason is not None:
            finish = "length" if reason == "length" else "stop"
        said = choice.get("stop_reason")
        if isinstance(said, str):
            stop_string = said
        if choice.get("logprobs") is not None:
            entries.extend(_logprobs(choice["logprobs"]))
    usage = obj.get("usage")
    prompt_tokens = completion_tokens = cached_tokens = None
    if isinstance(usage, dict):
        prompt_tokens = _count(usage.get("prompt_tokens"))
        completion_tokens = _count(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached_tokens = _count(details.get("cached_tokens"))
    return Chunk(
        text,
        finish,
        prompt_tokens,
        completion_tokens,
        _timings(obj.get("timings")),
        stop_string,
        tuple(entries),
        cached_tokens,
        reasoning,
        tuple(calls),
    )


def _reasoning(delta: dict[str, Any]) -> str:
    for key in ("reasoning_content", "reasoning"):
        value = delta.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _bad(f"the upstream sent a {key} that is not a string")
            return value
    return ""


def _tool_deltas(value: Any) -> list[ToolDelta]:
    """A delta's ``tool_calls``, checked for the shapes OpenAI streams."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("the upstream sent tool_calls that are not a list")
    out = []
    for position, part in enumerate(value):
        if not isinstance(part, dict):
            raise _bad("the upstream sent a tool call part that is not an object")
        index = part.get("index", position)
        function = part.get("function") or {}
        call_id = part.get("id")
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or not 0 <= index < 128
            or not isinstance(function, dict)
            or not isinstance(call_id, str | None)
            or not isinstance(name, str | None)
            or not isinstance(arguments, str | None)
        ):
            raise _bad("the upstream sent a malformed tool call part")
        out.append(ToolDelta(index, call_id or None, name or None, arguments or ""))
    return out


def _logprobs(value: Any) -> tuple[TokenLogprob, ...]:
    """A choice's ``logprobs``: the chat shape (``content``) or the legacy one
    (``tokens``, ``token_logprobs``, ``top_logprobs``), as entries."""
    try:
        if not isinstance(value, dict):
            raise ValueError("not an object")
        content = value.get("content")
        entries = parse_entries(content or []) if "content" in value else _legacy(value)
    except ValueError as exc:
        raise _bad(f"the upstream sent malformed logprobs: {exc}") from None
    for entry in entries:
        if len(entry.top) > MAX_TOP_LOGPROBS or entry.size() > MAX_ENTRY_BYTES:
            raise _bad("the upstream sent a logprob entry beyond the limits (20 alternatives)")
    return entries


def _legacy(value: dict[str, Any]) -> tuple[TokenLogprob, ...]:
    tokens, values = value.get("tokens") or [], value.get("token_logprobs") or []
    tops = value.get("top_logprobs") or [None] * len(tokens)
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)):
        raise ValueError("tokens, token_logprobs and top_logprobs must be lists")
    if not len(tokens) == len(values) == len(tops):
        raise ValueError("tokens, token_logprobs and top_logprobs differ in length")
    chat: list[dict[str, Any]] = []
    for token, logprob, top in zip(tokens, values, tops, strict=True):
        if top is not None and not isinstance(top, dict):
            raise ValueError("each top_logprobs entry must be an object")
        alternatives = [{"token": t, "logprob": v} for t, v in (top or {}).items()]
        chat.append(
            {
                "token": token,
                # The first token of an echoed prompt has none.
                "logprob": LOGPROB_FLOOR if logprob is None else logprob,
                "top_logprobs": alternatives,
            }
        )
    entries = parse_entries(chat)
    # Most likely first, as the chat shape lists them (a dict has no order to trust).
    return tuple(
        replace(entry, top=tuple(sorted(entry.top, key=lambda t: -t.logprob))) for entry in entries
    )


def _timings(value: object) -> dict[str, float] | None:
    """The known, finite, non-negative numbers of a ``timings`` object, or None."""
    if not isinstance(value, dict):
        return None
    out: dict[str, float] = {}
    for key in UPSTREAM_TIMINGS:
        number = value.get(key)
        if (
            isinstance(number, int | float)
            and not isinstance(number, bool)
            and math.isfinite(number)
            and number >= 0
        ):
            out[key] = number
    return out or None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _message_of(error: object) -> str:
    if isinstance(error, dict):
        error = error.get("message", error)
    text = error if isinstance(error, str) else orjson.dumps(error).decode()
    return _clip(text)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def error_message(status: int, body: bytes) -> str:
    """What to tell the client about an HTTP error: the upstream's own message.

    OpenAI-style servers answer ``{"error": {"message": …}}``; FastAPI-based
    ones ``{"detail": …}``; anything else is passed on as (clipped) text.
    """
    detail = ""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        detail = _clip(body.decode("utf-8", errors="replace"))
    else:
        if isinstance(obj, dict) and "error" in obj:
            detail = _message_of(obj["error"])
        elif isinstance(obj, dict) and "detail" in obj:
            detail = _message_of(obj["detail"])
        else:
            detail = _clip(body.decode("utf-8", errors="replace"))
    return f"the upstream answered HTTP {status}" + (f": {detail}" if detail else "")

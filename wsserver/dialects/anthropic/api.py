"""Anthropic's Messages API: request bodies and error objects, without the I/O (sans-I/O).

A ``POST /v1/messages`` body becomes a :class:`MessagesRequest`
(:func:`parse_body`) and then one :class:`~wsserver.core.protocol.Generate`
(:func:`to_generate`), validated by the WebSocket protocol's own parser: a
Messages request meets the same limits as every other, its fields named the
Messages API's way in the errors. ``POST /v1/messages/count_tokens`` takes
the same body, ``max_tokens`` optional (:func:`parse_body` with ``counting``).

**Honour or refuse, never ignore.** Every top-level field is honoured
(:data:`HONOURED`), accepted only with a value that changes nothing we produce
(:data:`HARMLESS`: ``service_tier`` ``auto``, a ``cache_control``, …), or
refused naming it (:data:`REFUSED`); any other is refused as unknown. Content
blocks, ``tools``, ``tool_choice`` and ``thinking`` are mapped onto the core's
chat by :mod:`wsserver.dialects.anthropic.content` (text, tool use and results,
thinking; images, documents and server tools are refused naming where they
were). A conversation that ends with an assistant turn (a "prefill" the
answer would continue) is refused too: the engines would start a new turn
instead of continuing it.

**Errors.** The dialect raises :class:`~wsserver.dialects.api_errors.ApiError` like
the other HTTP dialects; :func:`error_body` writes it in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, with Anthropic's status
(``overloaded`` is 529 ``overloaded_error``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from ...core.images import carry_images
from ...core.protocol import Generate, Limits, Message, parse_client_frame
from ...errors import ProtocolError
from ..api_errors import ERROR_TYPES, ApiError, Fields, in_dialect_names
from .content import (
    bad_request,
    parse_messages,
    parse_thinking,
    parse_tool_choice,
    parse_tools,
    text_of,
)

__all__ = [
    "HARMLESS",
    "HONOURED",
    "OVERLOADED",
    "REFUSED",
    "MessagesRequest",
    "anthropic_status",
    "bad_request",
    "error_body",
    "error_object",
    "parse_body",
    "refusal_wording",
    "to_generate",
]

#: Anthropic's status for an overloaded API (not an HTTP standard one).
OVERLOADED: Final = 529

#: Fields that shape the answer, and are honoured.
HONOURED: Final = frozenset(
    {
        "model",
        "system",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "metadata",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
        # An extension (Ollama's): how long the model stays loaded once idle.
        "keep_alive",
    }
)

#: Fields accepted only with values that change nothing we produce.
HARMLESS: Final[dict[str, Any]] = {
    "service_tier": lambda v: v in ("auto", "standard_only"),
    "speed": lambda v: v == "standard",
    # Prompt caching: the engines reuse cached prefixes by themselves.
    "cache_control": lambda v: isinstance(v, dict) and v.get("type") == "ephemeral",
    # Prompt-cache divergence reports: we have none to give (``diagnostics`` null).
    "diagnostics": lambda v: isinstance(v, dict),
    # Where and for whom it runs: here, for whoever holds the token.
    "inference_geo": lambda v: isinstance(v, str),
    "user_profile_id": lambda v: isinstance(v, str),
    "workspace_id": lambda v: isinstance(v, str),
}

#: Fields refused with a reason (when not harmless as given).
REFUSED: Final[dict[str, str]] = {
    "service_tier": "only 'auto' or 'standard_only' is accepted",
    "speed": "only 'standard' is accepted",
    "cache_control": "only {'type': 'ephemeral'} is accepted",
    "container": "server tools (containers) are not supported",
    "mcp_servers": "MCP servers (server tools) are not supported",
    "context_management": "context management is not supported",
    "output_config": "output configuration (effort, structured output) is not supported yet",
    "output_format": "structured output is not supported yet",
}


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated Messages request."""

    messages: tuple[Message, ...]
    #: Required by a message (``None`` only when counting tokens).
    max_tokens: int | None
    model: str | None = None
    system: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: tuple[str, ...] = ()
    user_id: str | None = None
    stream: bool = False
    #: The core's function tools (:mod:`wsserver.dialects.anthropic.content`), or None.
    tools: list[dict[str, Any]] | None = None
    #: ``tool_choice`` and ``parallel_tool_calls`` for the ``generate`` frame.
    tool_fields: dict[str, Any] = field(default_factory=dict)
    #: From ``thinking``: ``auto`` (enabled), ``none`` (disabled), None (not given).
    reasoning_format: str | None = None
    #: ``keep_alive`` as given (the ``generate`` frame's parser checks it).
    keep_alive: Any = None
    #: ``thinking.budget_tokens`` (enabled only): the core's ``reasoning_budget_tokens``.
    reasoning_budget: int | None = None


# ---------------------------------------------------------------- errors

#: Anthropic's error type of each status it answers with: OpenAI's names but
#: for a body too large and its own 529 (else ``api_error``).
_TYPES: Final[dict[int, str]] = {
    **ERROR_TYPES,
    413: "request_too_large",
    OVERLOADED: "overloaded_error",
}


def anthropic_status(status: int, code: str) -> int:
    """Anthropic's status for one of ours: an overloaded server — its queue
    full, or stopping (a request it cancels) — is 529."""
    return OVERLOADED if code in ("overloaded", "cancelled") else status


def error_object(status: int, message: str) -> dict[str, Any]:
    """The whole error object: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def error_body(error: ApiError) -> tuple[int, bytes]:
    """An :class:`ApiError` as Anthropic answers it: its status and body."""
    status = anthropic_status(error.status, error.code)
    return status, orjson.dumps(error_object(status, error.message))


# ---------------------------------------------------------------- bodies


def parse_body(obj: Mapping[str, Any], *, counting: bool = False) -> MessagesRequest:
    """Validate a body (of ``count_tokens``: ``counting``, ``max_tokens`` optional)."""
    given = {key: value for key, value in obj.items() if value is not None}
    for name, value in given.items():
        _check_field(name, value)
    if "messages" not in given:
        raise bad_request("messages: field required", "messages")
    max_tokens = given.get("max_tokens")
    if max_tokens is None and not counting:
        raise bad_request("max_tokens: field required", "max_tokens")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise bad_request("max_tokens: must be an integer >= 1", "max_tokens")
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be a boolean", "stream")
    top_k = given.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise bad_request("top_k: must be an integer >= 0", "top_k")
    tools = parse_tools(given["tools"]) if "tools" in given else None
    tool_fields = parse_tool_choice(given["tool_choice"], tools) if "tool_choice" in given else {}
    thinking = given.get("thinking")
    return MessagesRequest(
        messages=parse_messages(given["messages"]),
        max_tokens=max_tokens,
        model=_string(given, "model"),
        system=_system(given.get("system")),
        temperature=_unit_number(given, "temperature"),
        top_p=_unit_number(given, "top_p"),
        top_k=top_k,
        stop_sequences=_stop_sequences(given.get("stop_sequences", [])),
        user_id=_metadata(given.get("metadata", {})),
        stream=stream,
        tools=tools,
        tool_fields=tool_fields,
        reasoning_format=None if thinking is None else parse_thinking(thinking, max_tokens),
        keep_alive=given.get("keep_alive"),
        reasoning_budget=None if thinking is None else thinking.get("budget_tokens"),
    )


_FIELDS: Final = Fields(HONOURED, HARMLESS, REFUSED)


def _check_field(name: str, value: Any) -> None:
    reason = _FIELDS.refusal(name, value)
    if reason:
        raise bad_request(f"{name}: not supported: {reason}", name, "unsupported_parameter")
    if reason is not None:
        raise bad_request(f"{name}: unknown field (extra inputs are not permitted)", name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(given: Mapping[str, Any], name: str) -> str | None:
    value = given.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name}: must be a string", name)
    return value


def _unit_number(given: Mapping[str, Any], name: str) -> float | None:
    value = given.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise bad_request(f"{name}: must be a number between 0 and 1", name)
    return float(value)


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request("stop_sequences: must be a list of non-empty strings", "stop_sequences")
    return tuple(value)


def _metadata(value: Any) -> str | None:
    if not isinstance(value, dict):
        raise bad_request("metadata: must be an object", "metadata")
    for key in value:
        if key != "user_id":
            raise bad_request(f"metadata.{key}: unknown field (only user_id)", "metadata")
    user_id = value.get("user_id")
    if user_id is not None and (not isinstance(user_id, str) or len(user_id) > 256):
        raise bad_request(
            "metadata.user_id: must be a string of at most 256 characters", "metadata"
        )
    return user_id


def _system(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if not isinstance(value, list):
        raise bad_request("system: must be a string or a list of text blocks", "system")
    return text_of(value, "system", "system") or None


def to_generate(request: MessagesRequest, request_id: str, limits: Limits) -> Generate:
    """The engine's request: the system prompt, then the conversation."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": request.system})
    messages.extend(m.to_frame() for m in request.messages)
    frame: dict[str, Any] = {"type": "generate", "id": request_id, "messages": messages}
    if request.tools is not None:
        frame["tools"] = request.tools
        frame.update(request.tool_fields)
    optional = {
        "reasoning_format": request.reasoning_format,
        "reasoning_budget_tokens": request.reasoning_budget,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "stop": list(request.stop_sequences) or None,
        "keep_alive": request.keep_alive,
    }
    frame.update((name, value) for name, value in optional.items() if value is not None)
    try:
        generate = parse_client_frame(orjson.dumps(frame).decode(), limits)
        assert isinstance(generate, Generate)
        fail = functools.partial(ProtocolError, "bad_request")
        generate = carry_images(generate, request.messages, 1 if request.system else 0, fail)
    except ProtocolError as exc:
        raise _renamed(ApiError.from_protocol(exc)) from None
    return generate


#: The protocol's field names in its messages → the Messages API's names.
_PARAMS: Final = {
    "stop": "stop_sequences",
    "max_tokens": "max_tokens",
    "messages": "messages",
    "keep_alive": "keep_alive",
    "reasoning_budget_tokens": "thinking.budget_tokens",
}


def refusal_wording(message: str) -> str:
    """An engine's refusal (``bad_request``, ``unsupported_option``) in the
    Messages API's names (:data:`_PARAMS`): ``'reasoning_budget_tokens'`` is
    ``'thinking.budget_tokens'`` here."""
    return in_dialect_names(message, _PARAMS)


def _renamed(error: ApiError) -> ApiError:
    for ours, theirs in _PARAMS.items():
        if f"'{ours}'" in error.message or f"{ours} " in error.message:
            message = error.message.replace(f"'{ours}'", f"'{theirs}'")
            error.message = f"{theirs}: " + message.replace("stop string", "stop sequence")
            error.param = theirs
            break
    return error

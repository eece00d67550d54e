"""The OpenAI Responses API's request bodies, without the I/O (sans-I/O).

A ``POST /v1/responses`` body — or a WebSocket-mode ``response.create`` event,
which carries the same fields — becomes a :class:`ResponsesRequest`
(:func:`parse_body`), and with the conversation a ``previous_response_id``
names, one :class:`~wsserver.protocol.Generate` (:func:`to_generate`): it is
validated by the WebSocket protocol's own parser, so a Responses request meets
the same limits, with the same messages, as every other.

**Honour or refuse, never ignore.** Every field is in one of three tables:
honoured (:data:`HONOURED`), accepted because it changes nothing we produce
(:data:`HARMLESS`, with the values that keep it so), or refused by name
(:data:`REFUSED`: tools, reasoning, structured output, background mode, …).
A field in none of them is refused as unknown. Input items are messages with
``input_text`` (or, for the assistant, ``output_text``) parts; every other item
or part type is refused naming it. ``null`` means "not given".

The events and response objects are :mod:`wsserver.responses_render`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final

import orjson

from .api_errors import ApiError
from .errors import ProtocolError
from .protocol import Generate, Limits, parse_client_frame

__all__ = [
    "HARMLESS",
    "HONOURED",
    "REFUSED",
    "Message",
    "ResponsesRequest",
    "bad_request",
    "parse_body",
    "parse_json",
    "to_generate",
]

#: One message of a conversation, as the protocol's ``generate`` takes it.
Message = Mapping[str, str]

#: Fields that shape the answer, and are honoured.
HONOURED: Final = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "metadata",
        "store",
        "stream",
        "previous_response_id",
    }
)


def _no_tools(value: Any) -> bool:
    return isinstance(value, list) and not value


#: Fields accepted only with values that change nothing we produce.
HARMLESS: Final[dict[str, Any]] = {
    "user": lambda v: isinstance(v, str),
    "safety_identifier": lambda v: isinstance(v, str),
    "prompt_cache_key": lambda v: isinstance(v, str),
    "prompt_cache_retention": lambda v: isinstance(v, str),
    "service_tier": lambda v: v in ("auto", "default"),
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "truncation": lambda v: v == "disabled",
    "include": _no_tools,
    "tools": _no_tools,
    "tool_choice": lambda v: v in ("auto", "none"),
    "text": lambda v: v == {"format": {"type": "text"}} or v == {},
    "background": lambda v: v is False,
    "top_logprobs": lambda v: v == 0,
    "stream_options": lambda v: isinstance(v, dict),
}

#: Fields refused with a reason (when not harmless as given).
REFUSED: Final[dict[str, str]] = {
    "tools": "tools are not supported yet (function calling is a later release)",
    "tool_choice": "tool_choice needs tools, which are not supported yet",
    "reasoning": "reasoning options are not supported yet",
    "text": "text.format other than {'type': 'text'} (structured output) is not supported yet",
    "background": "background mode is not supported",
    "include": "include is not supported (no extra output data is available)",
    "truncation": "only truncation 'disabled' is supported",
    "top_logprobs": "logprobs are not supported",
    "service_tier": "only service_tier 'auto' or 'default' is supported",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "tools are not supported yet",
    "context_management": "context management is not supported",
}

_ROLES: Final = {
    "user": "user",
    "system": "system",
    "developer": "system",
    "assistant": "assistant",
}
_METADATA_PAIRS: Final = 16


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses request (before its conversation is looked up)."""

    #: This turn's input, as messages (``developer`` is ``system``).
    input: tuple[Message, ...]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    #: WebSocket mode: the lane the response runs in (its events echo it).
    stream_id: str | None = None


def bad_request(message: str, param: str | None = None, code: str = "bad_request") -> ApiError:
    """A 400 with OpenAI's error object."""
    return ApiError(HTTPStatus.BAD_REQUEST, message, code, param)


def parse_json(body: bytes | str) -> dict[str, Any]:
    """A JSON object, or :class:`ApiError` ``bad_json``."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"invalid JSON: {exc.msg}", "bad_json") from None
    if not isinstance(obj, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object", "bad_json")
    return obj


def parse_body(obj: Mapping[str, Any], *, websocket: bool = False) -> ResponsesRequest:
    """Validate a body (or a ``response.create`` event's fields, ``websocket``)."""
    given = {key: value for key, value in obj.items() if value is not None}
    if websocket:
        given.pop("type", None)
    for name, value in given.items():
        _check_field(name, value, websocket=websocket)
    if "input" not in given:
        raise bad_request("'input' is required", "input")
    stream = given.get("stream", websocket)
    if not isinstance(stream, bool) or (websocket and not stream):
        raise bad_request("'stream' must be a boolean (and true over a WebSocket)", "stream")
    store = given.get("store", True)
    if not isinstance(store, bool):
        raise bad_request("'store' must be a boolean", "store")
    return ResponsesRequest(
        input=_input(given["input"]),
        model=_string(given, "model"),
        instructions=_string(given, "instructions"),
        max_output_tokens=_number(given, "max_output_tokens", integer=True),
        temperature=_number(given, "temperature"),
        top_p=_number(given, "top_p"),
        metadata=_metadata(given.get("metadata", {})),
        store=store,
        stream=stream,
        previous_response_id=_string(given, "previous_response_id"),
        stream_id=_string(given, "stream_id") if websocket else None,
    )


def _check_field(name: str, value: Any, *, websocket: bool) -> None:
    if name in HONOURED or (websocket and name == "stream_id"):
        return
    harmless = HARMLESS.get(name)
    if harmless is not None and harmless(value):
        return
    reason = REFUSED.get(name)
    if reason is not None:
        raise bad_request(f"'{name}' is not supported: {reason}", name, "unsupported_parameter")
    raise bad_request(f"unknown field '{name}'", name, "unknown_parameter")


def _string(given: Mapping[str, Any], name: str) -> str | None:
    value = given.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name)
    return value


def _number(given: Mapping[str, Any], name: str, *, integer: bool = False) -> Any:
    value = given.get(name)
    if value is None:
        return None
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    return value


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise bad_request("'metadata' must be an object of strings", "metadata")
    if len(value) > _METADATA_PAIRS:
        raise bad_request(f"'metadata' may have at most {_METADATA_PAIRS} pairs", "metadata")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise bad_request(
                "'metadata' keys are at most 64 characters, values strings of at most 512",
                "metadata",
            )
    return dict(value)


def _input(value: Any) -> tuple[Message, ...]:
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of items", "input")
    return tuple(_item(item, index) for index, item in enumerate(value))


_MESSAGE_KEYS: Final = frozenset({"type", "role", "content", "id", "status"})


def _item(item: Any, index: int) -> Message:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind != "message":
        raise bad_request(
            f"{where}: items of type {kind!r} are not supported (only 'message')", "input"
        )
    for key in item:
        if key not in _MESSAGE_KEYS:
            raise bad_request(f"{where}: unknown field {key!r}", "input")
    role = item.get("role")
    mapped = _ROLES.get(role) if isinstance(role, str) else None
    if mapped is None:
        raise bad_request(
            f"{where}.role must be one of user, system, developer, assistant", "input"
        )
    return {"role": mapped, "content": _content(item.get("content"), where, mapped)}


def _content(value: Any, where: str, role: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    allowed = ("output_text",) if role == "assistant" else ("input_text",)
    texts = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise bad_request(
                f"{where}.content[{index}]: parts of type {kind!r} are not supported"
                f" (only {allowed[0]!r} for the {role})",
                "input",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{index}] needs a string 'text'", "input")
        texts.append(text)
    return "".join(texts)


def to_generate(
    request: ResponsesRequest,
    history: Sequence[Message],
    request_id: str,
    limits: Limits,
) -> Generate:
    """The engine's request: the instructions, the earlier conversation, this input."""
    messages: list[Message] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages.extend(history)
    messages.extend(request.input)
    # The Responses API's reasoning items are not rendered yet ("reasoning" is
    # refused): a think block stays in the text rather than being dropped.
    frame: dict[str, Any] = {
        "type": "generate",
        "id": request_id,
        "messages": messages,
        "reasoning_format": "none",
    }
    if request.max_output_tokens is not None:
        frame["max_tokens"] = request.max_output_tokens
    if request.temperature is not None:
        frame["temperature"] = request.temperature
    if request.top_p is not None:
        frame["top_p"] = request.top_p
    try:
        generate = parse_client_frame(orjson.dumps(frame).decode(), limits)
    except ProtocolError as exc:
        # The protocol names its own fields; say the Responses API's names.
        error = ApiError.from_protocol(exc)
        for ours, theirs in _PARAMS.items():
            if f"'{ours}'" in error.message or f"{ours} " in error.message:
                error.message = error.message.replace(ours, theirs)
                error.param = theirs
                break
        raise error from None
    assert isinstance(generate, Generate)
    return generate


#: The protocol's field names in its messages → the Responses API's names.
_PARAMS: Final = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "temperature": "temperature",
    "top_p": "top_p",
}

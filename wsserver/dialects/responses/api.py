"""The OpenAI Responses API's request bodies, without the I/O (sans-I/O).

A ``POST /v1/responses`` body — or a WebSocket-mode ``response.create`` event,
which carries the same fields — becomes a :class:`ResponsesRequest`
(:func:`parse_body`), and with the conversation a ``previous_response_id``
names, one :class:`~wsserver.core.protocol.Generate` (:func:`to_generate`): it is
validated by the WebSocket protocol's own parser, so a Responses request meets
the same limits, with the same messages, as every other.

**Honour or refuse, never ignore.** Every field is in one of three tables:
honoured (:data:`HONOURED`), accepted because it changes nothing we produce
(:data:`HARMLESS`, with the values that keep it so), or refused by name
(:data:`REFUSED`: reasoning options, background mode, …).
A field in none of them is refused as unknown. ``null`` means "not given".

Input items and function tools are :mod:`wsserver.dialects.responses.items`'s.
The events and response objects are :mod:`wsserver.dialects.responses.render`'s.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from ...core.images import ImageBudget, ImageUrl, with_images
from ...core.protocol import Generate, Limits, parse_client_frame
from ...errors import ProtocolError

# parse_json: re-exported for the WebSocket mode's events (aio/responses_socket.py).
from ..api_errors import ApiError, Fields, in_dialect_names, parse_json
from .items import (
    Message,
    bad_request,
    chat_tools,
    check_outputs,
    parse_choice,
    parse_function_tools,
    parse_input,
)

__all__ = [
    "HARMLESS",
    "HONOURED",
    "REFUSED",
    "Message",
    "ResponsesRequest",
    "bad_request",
    "parse_body",
    "parse_json",
    "refusal_wording",
    "to_generate",
]

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
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        # An extension (Ollama's): how long the model stays loaded once idle.
        "keep_alive",
    }
)


def _empty_list(value: Any) -> bool:
    return isinstance(value, list) and not value


def _default_reasoning(value: Any) -> bool:
    # What SDKs send when nothing is asked: the model reasons as it does, and
    # its reasoning comes back as a reasoning item's content.
    return isinstance(value, dict) and all(v is None for v in value.values())


#: Fields accepted only with values that change nothing we produce.
HARMLESS: Final[dict[str, Any]] = {
    "user": lambda v: isinstance(v, str),
    "safety_identifier": lambda v: isinstance(v, str),
    "prompt_cache_key": lambda v: isinstance(v, str),
    "prompt_cache_retention": lambda v: isinstance(v, str),
    "service_tier": lambda v: v in ("auto", "default"),
    "truncation": lambda v: v == "disabled",
    "include": _empty_list,
    "reasoning": _default_reasoning,
    "background": lambda v: v is False,
    "top_logprobs": lambda v: v == 0,
    "stream_options": lambda v: isinstance(v, dict),
}

#: Fields refused with a reason (when not harmless as given).
REFUSED: Final[dict[str, str]] = {
    "reasoning": (
        "reasoning effort and summaries are not supported (the model reasons as it does;"
        " its reasoning text comes back as a 'reasoning' output item)"
    ),
    "background": "background mode is not supported",
    "include": "include is not supported (no extra output data is available)",
    "truncation": "only truncation 'disabled' is supported",
    "top_logprobs": "logprobs are not supported",
    "service_tier": "only service_tier 'auto' or 'default' is supported",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "a limit on calls is not enforced (parallel_tool_calls false: one)",
    "context_management": "context management is not supported",
}

_FIELDS: Final = Fields(HONOURED, HARMLESS, REFUSED)
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
    #: The function tools as given (Responses shape), echoed in the response.
    tools: tuple[Mapping[str, Any], ...] = ()
    #: ``tool_choice`` as given (``None``: not given).
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    #: WebSocket mode: the lane the response runs in (its events echo it).
    stream_id: str | None = None
    #: ``text.format`` as given (echoed), and the JSON Schema it asks the
    #: output to follow (None: plain text).
    text_format: Mapping[str, Any] = field(default_factory=lambda: {"type": "text"})
    json_schema: Any = None
    #: ``keep_alive`` as given (the ``generate`` frame's parser checks it).
    keep_alive: Any = None


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
    parallel = given.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return ResponsesRequest(
        input=parse_input(given["input"]),
        model=_string(given, "model"),
        instructions=_string(given, "instructions"),
        max_output_tokens=_number(given, "max_output_tokens", integer=True),
        temperature=_number(given, "temperature"),
        top_p=_number(given, "top_p"),
        metadata=_metadata(given.get("metadata", {})),
        store=store,
        stream=stream,
        previous_response_id=_string(given, "previous_response_id"),
        tools=parse_function_tools(given.get("tools", [])),
        tool_choice=parse_choice(given.get("tool_choice")),
        parallel_tool_calls=parallel,
        stream_id=_string(given, "stream_id") if websocket else None,
        keep_alive=given.get("keep_alive"),
        **_text_format(given.get("text", {})),
    )


def _text_format(value: Any) -> dict[str, Any]:
    """``text``: its ``format`` — ``text``, ``json_object`` (any JSON object) or
    ``json_schema`` (``schema``, with its ``name``; ``strict`` changes nothing:
    the grammar always holds the output to the schema)."""
    if not isinstance(value, dict):
        raise bad_request("'text' must be an object", "text")
    for key in value:
        if key != "format":
            raise bad_request(
                f"'text.{key}' is not supported (only 'text.format')",
                f"text.{key}",
                "unsupported_parameter",
            )
    fmt = value.get("format", {"type": "text"})
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return {"text_format": {"type": "text"}}
    if kind == "json_object":
        return {"text_format": {"type": "json_object"}, "json_schema": {"type": "object"}}
    if kind == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("'text.format.name' is required for json_schema", "text.format.name")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request(
                "'text.format.schema' must be an object (a JSON Schema)", "text.format.schema"
            )
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("'text.format.strict' must be a boolean", "text.format.strict")
        echoed = {"type": "json_schema", "name": name, "schema": schema, "strict": bool(strict)}
        if isinstance(fmt.get("description"), str):
            echoed["description"] = fmt["description"]
        return {"text_format": echoed, "json_schema": schema}
    raise bad_request(
        "'text.format.type' must be one of text, json_object, json_schema", "text.format.type"
    )


def _check_field(name: str, value: Any, *, websocket: bool) -> None:
    reason = None if websocket and name == "stream_id" else _FIELDS.refusal(name, value)
    if reason:
        raise bad_request(f"'{name}' is not supported: {reason}", name, "unsupported_parameter")
    if reason is not None:
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


def _tool_choice(request: ResponsesRequest) -> dict[str, Any]:
    """``tool_choice`` and ``parallel_tool_calls`` as the ``generate`` frame
    takes them (its parser checks them, the engine refuses what it cannot
    force). Without tools the values that change nothing are dropped."""
    out: dict[str, Any] = {}
    choice = request.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if request.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = request.parallel_tool_calls
    if not request.tools:
        if out.get("tool_choice") in ("auto", "none"):
            del out["tool_choice"]
        out.pop("parallel_tool_calls", None)
    return out


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
    check_outputs(messages)
    # No reasoning_format: the server's default splits a think block into a
    # reasoning item (``auto``) or leaves it in the text (``none``).
    images = _images(messages)
    messages = [{k: v for k, v in m.items() if k != "images"} for m in messages]
    frame: dict[str, Any] = {"type": "generate", "id": request_id, "messages": messages}
    if request.tools:
        frame["tools"] = chat_tools(request.tools)
    frame.update(_tool_choice(request))
    optional = {
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "json_schema": request.json_schema,
        "keep_alive": request.keep_alive,
    }
    frame.update((name, value) for name, value in optional.items() if value is not None)
    try:
        generate = parse_client_frame(orjson.dumps(frame).decode(), limits)
        assert isinstance(generate, Generate)
        if images and generate.messages is not None:
            fail = functools.partial(ProtocolError, "bad_request")
            generate = dataclasses.replace(
                generate, messages=with_images(generate.messages, images, fail)
            )
    except ProtocolError as exc:
        # The protocol names its own fields; say the Responses API's names.
        error = ApiError.from_protocol(exc)
        # The core's tools are the chat API's: name the Responses API's fields.
        error.message = re.sub(r"(tools\[\d+\])\.function\.", r"\1.", error.message)
        if error.message.startswith("messages["):
            error.message = "the conversation's " + error.message
            error.param = "input"
        elif error.message.startswith("tools["):
            error.param = "tools"
        for ours, theirs in _PARAMS.items():
            if f"'{ours}'" in error.message or f"{ours} " in error.message:
                error.message = error.message.replace(ours, theirs)
                error.param = theirs
                break
        raise error from None
    assert isinstance(generate, Generate)
    return generate


def _images(messages: Sequence[Message]) -> dict[int, list[bytes]]:
    """The images, by message index, decoded: they travel beside the frame
    (which is JSON); the earlier turns' and this input's held together to
    one request's bounds (:class:`~wsserver.core.images.ImageBudget`)."""
    budget = ImageBudget(functools.partial(ProtocolError, "bad_request"))
    found: dict[int, list[bytes]] = {}
    try:
        for index, message in enumerate(messages):
            for image in message.get("images", ()):
                if isinstance(image, ImageUrl):  # the WebSocket mode: nothing is fetched
                    why = "http(s) image URLs are fetched over HTTP only (when the operator"
                    why += " allows their host), not in the WebSocket mode; send a data: URL"
                    raise bad_request(image.refusal(why), "input")
                where = f"the conversation's messages[{index}]"
                found.setdefault(index, []).append(budget.take(base64.b64decode(image), where))
    except ProtocolError as exc:
        raise bad_request(exc.message, "input") from None
    return found


def refusal_wording(message: str) -> str:
    """An engine's refusal (``bad_request``, ``unsupported_option``) in the
    Responses API's names (:data:`_PARAMS`): ``'json_schema'`` is
    ``'text.format'`` here."""
    return in_dialect_names(message, _PARAMS)


#: The protocol's field names in its messages → the Responses API's names.
_PARAMS: Final = {
    "max_tokens": "max_output_tokens",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
    "messages": "input",
    "tools": "tools",
    "temperature": "temperature",
    "top_p": "top_p",
    "json_schema": "text.format",
}

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
(:data:`REFUSED`: reasoning options, structured output, background mode, …).
A field in none of them is refused as unknown. ``null`` means "not given".

**Items in.** Messages with ``input_text`` (or, for the assistant,
``output_text``) parts; ``function_call`` items (a call the model made: the
assistant message's ``tool_calls``, consecutive calls joined into one
message) and ``function_call_output`` items (its result: a ``tool`` message
naming the ``call_id``); ``reasoning`` items are accepted and not shown to the
model, as a ``previous_response_id`` chain does not show earlier reasoning.
Every other item or part type is refused naming it.

**Tools.** Function tools in the Responses shape (``name`` at the top level)
become the core's OpenAI function tools (:func:`wsserver.chat_input.parse_tools`
checks them); ``tool_choice`` and ``parallel_tool_calls`` map onto the same
``generate`` fields as the chat API's, so an engine that cannot force a call
refuses ``required`` or a named function itself. Built-in tools (web search,
file search, …) and ``strict: true`` (arguments that match the schema, which
nothing enforces yet) are refused by name.

The events and response objects are :mod:`wsserver.responses_render`'s.
"""

from __future__ import annotations

import re
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

#: One message of a conversation, as the protocol's ``generate`` takes it
#: (OpenAI's chat shape: ``role``, ``content``, maybe ``tool_calls`` or
#: ``tool_call_id``).
Message = Mapping[str, Any]

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
    "text": lambda v: v == {"format": {"type": "text"}} or v == {},
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
    "text": "text.format other than {'type': 'text'} (structured output) is not supported yet",
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
    #: The function tools as given (Responses shape), echoed in the response.
    tools: tuple[Mapping[str, Any], ...] = ()
    #: ``tool_choice`` as given (``None``: not given).
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
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
    parallel = given.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
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
        tools=_tools(given.get("tools", [])),
        tool_choice=_choice(given.get("tool_choice")),
        parallel_tool_calls=parallel,
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
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                # The calls of one turn (after its text, if any): one assistant message.
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_output(item, where))
        elif kind == "reasoning":
            _only(item, where, _REASONING_KEYS)
        else:
            raise bad_request(
                f"{where}: items of type {kind!r} are not supported (only 'message',"
                " 'function_call', 'function_call_output' and 'reasoning')",
                "input",
            )
    return tuple(messages)


_MESSAGE_KEYS: Final = frozenset({"type", "role", "content", "id", "status"})
_CALL_KEYS: Final = frozenset({"type", "id", "call_id", "name", "arguments", "status"})
_OUTPUT_KEYS: Final = frozenset({"type", "id", "call_id", "output", "status"})
_REASONING_KEYS: Final = frozenset(
    {"type", "id", "summary", "content", "encrypted_content", "status"}
)
_TOOL_KEYS: Final = frozenset({"type", "name", "description", "parameters", "strict"})


def _only(item: Mapping[str, Any], where: str, keys: frozenset[str]) -> None:
    for key in item:
        if key not in keys:
            raise bad_request(f"{where}: unknown field {key!r}", "input")


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    _only(item, where, _MESSAGE_KEYS)
    role = item.get("role")
    mapped = _ROLES.get(role) if isinstance(role, str) else None
    if mapped is None:
        raise bad_request(
            f"{where}.role must be one of user, system, developer, assistant", "input"
        )
    return {"role": mapped, "content": _content(item.get("content"), where, mapped)}


def _text_field(item: Mapping[str, Any], where: str, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string", "input")
    return value


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    _only(item, where, _CALL_KEYS)
    return {
        "id": _text_field(item, where, "call_id"),
        "type": "function",
        "function": {
            "name": _text_field(item, where, "name"),
            "arguments": _text_field(item, where, "arguments"),
        },
    }


def _function_output(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    _only(item, where, _OUTPUT_KEYS)
    output = item.get("output")
    if isinstance(output, list):
        output = _content(output, f"{where}.output", "user")
    elif not isinstance(output, str):
        raise bad_request(
            f"{where}.output must be a string or a list of 'input_text' parts", "input"
        )
    return {
        "role": "tool",
        "tool_call_id": _text_field(item, where, "call_id"),
        "content": output,
    }


def _tools(value: Any) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", "tools")
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"{where}: tools of type {str(kind)[:40]!r} are not supported (only 'function'"
                " tools; built-in tools such as web_search or file_search are not available)",
                "tools",
                "unsupported_parameter",
            )
        for key in tool:
            if key not in _TOOL_KEYS:
                raise bad_request(f"{where}: unknown field {key!r}", "tools")
        if tool.get("strict") is True:
            raise bad_request(
                f"{where}.strict: true is not supported (nothing makes the arguments match"
                " the schema yet; calls are checked to name a tool and be a JSON object):"
                " give strict: false",
                "tools",
                "unsupported_parameter",
            )
    return tuple(value)


def _check_outputs(messages: Sequence[Message]) -> None:
    """Each ``function_call_output`` answers a call made before it (as OpenAI checks)."""
    made: set[str] = set()
    for message in messages:
        for call in message.get("tool_calls") or ():
            made.add(call["id"])
        answered = message.get("tool_call_id")
        if answered is not None and answered not in made:
            raise bad_request(
                f"a function_call_output names call_id {str(answered)[:80]!r}, which no"
                " function_call before it in the conversation made",
                "input",
            )


def _choice(value: Any) -> Any:
    """``tool_choice``: a mode, or one function (``{"type": "function", "name": …}``)."""
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict):
        kind = value.get("type")
        if kind == "function" and set(value) == {"type", "name"}:
            if not isinstance(value["name"], str):
                raise bad_request("'tool_choice'.name must be a string", "tool_choice")
            return value
        if kind != "function":
            raise bad_request(
                f"'tool_choice' of type {str(kind)[:40]!r} is not supported (only function"
                " tools are)",
                "tool_choice",
                "unsupported_parameter",
            )
    raise bad_request(
        "'tool_choice' must be \"auto\", \"none\", \"required\" or {'type': 'function', 'name': …}",
        "tool_choice",
    )


def _chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The tools in the chat API's shape, which the core takes."""
    return [
        {
            "type": "function",
            "function": {
                key: tool[key]
                for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None
            },
        }
        for tool in tools
    ]


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
    _check_outputs(messages)
    # No reasoning_format: the server's default splits a think block into a
    # reasoning item (``auto``) or leaves it in the text (``none``).
    frame: dict[str, Any] = {"type": "generate", "id": request_id, "messages": messages}
    if request.tools:
        frame["tools"] = _chat_tools(request.tools)
    frame.update(_tool_choice(request))
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


#: The protocol's field names in its messages → the Responses API's names.
_PARAMS: Final = {
    "max_tokens": "max_output_tokens",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
    "messages": "input",
    "tools": "tools",
    "temperature": "temperature",
    "top_p": "top_p",
}

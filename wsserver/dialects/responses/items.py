"""The Responses API's input items and function tools, as the core takes them (sans-I/O).

**Items in.** Messages with ``input_text`` and ``input_image`` parts (or,
for the assistant, ``output_text``) — an image given as a ``data:`` URL in
``image_url`` (no ``file_id``), checked from its header
(:mod:`wsserver.core.images`), kept in its message as base64 under
``images`` (a stored conversation's size counts it) and its place in the
text marked — an ``http(s)`` URL is an :class:`~wsserver.core.images.ImageUrl`
there until the asyncio layer fetches it (behind the operator's allow-list)
and :func:`with_fetched` puts its bytes, as base64, in its place; ``function_call`` items (a call the model made: the
assistant message's ``tool_calls``, consecutive calls joined into one
message) and ``function_call_output`` items (its result: a ``tool`` message
naming the ``call_id``); a ``reasoning`` item's text (its ``content``
``reasoning_text`` parts, else its ``summary`` parts) is the ``reasoning`` of
the assistant message or ``function_call`` that follows it — the core hands
it to chat templates, which show it for the turn in progress (a tool-use
loop) and leave earlier turns' out; one that nothing of the assistant's
follows is dropped, and so is ``encrypted_content`` (nothing here can read
it). Every other item or part type is refused naming it.

**Tools.** Function tools in the Responses shape (``name`` at the top level)
become the core's OpenAI function tools (:func:`wsserver.core.chat_input.parse_tools`
checks them); ``tool_choice`` and ``parallel_tool_calls`` map onto the same
``generate`` fields as the chat API's, so an engine that cannot force a call
refuses ``required`` or a named function itself. Built-in tools (web search,
file search, …) and ``strict: true`` (arguments that match the schema, which
nothing enforces yet) are refused by name.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Final

from ...core.images import IMAGE_MARKER, ImageBudget, ImageUrl
from ...errors import ProtocolError
from ..api_errors import ApiError

__all__ = [
    "Message",
    "bad_request",
    "chat_tools",
    "check_outputs",
    "input_urls",
    "parse_choice",
    "parse_function_tools",
    "parse_input",
    "with_fetched",
]

#: One message of a conversation, as the protocol's ``generate`` takes it
#: (OpenAI's chat shape: ``role``, ``content``, maybe ``tool_calls`` or
#: ``tool_call_id``).
Message = Mapping[str, Any]

_ROLES: Final = {
    "user": "user",
    "system": "system",
    "developer": "system",
    "assistant": "assistant",
}


def bad_request(message: str, param: str | None = None, code: str = "bad_request") -> ApiError:
    """A 400 with OpenAI's error object."""
    return ApiError(HTTPStatus.BAD_REQUEST, message, code, param)


def parse_input(value: Any) -> tuple[Message, ...]:
    """``input``: a string (one user message) or items, as chat messages."""
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of items", "input")
    messages: list[dict[str, Any]] = []
    #: Reasoning items' texts not yet attached to an assistant message.
    reasoning: list[str] = []
    images = ImageBudget(lambda message: ProtocolError("bad_request", message))
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where, images)
            if message["role"] == "assistant":
                _attach(message, reasoning)
            reasoning.clear()
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                # The calls of one turn (after its text, if any): one assistant message.
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                last = {"role": "assistant", "content": None, "tool_calls": [call]}
                messages.append(last)
            _attach(last, reasoning)
            reasoning.clear()
        elif kind == "function_call_output":
            messages.append(_function_output(item, where))
            reasoning.clear()
        elif kind == "reasoning":
            _only(item, where, _REASONING_KEYS)
            text = _reasoning_text(item, where)
            if text:
                reasoning.append(text)
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


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts, else its summary."""
    for name, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(name)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad_request(f"{where}.{name} must be a list of {part_type!r} parts", "input")
        texts = []
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            text = part.get("text") if isinstance(part, dict) else None
            if kind != part_type or not isinstance(text, str):
                raise bad_request(
                    f"{where}.{name}[{index}] must be {{'type': {part_type!r}, 'text': …}}",
                    "input",
                )
            texts.append(text)
        if texts:
            return "".join(texts) if name == "content" else "\n\n".join(texts)
    return ""


def _attach(message: dict[str, Any], reasoning: list[str]) -> None:
    """Give an assistant message the reasoning items that preceded it."""
    if reasoning:
        texts = [message["reasoning"]] if "reasoning" in message else []
        message["reasoning"] = "\n\n".join([*texts, *reasoning])


def _message(item: Mapping[str, Any], where: str, images: ImageBudget) -> dict[str, Any]:
    _only(item, where, _MESSAGE_KEYS)
    role = item.get("role")
    mapped = _ROLES.get(role) if isinstance(role, str) else None
    if mapped is None:
        raise bad_request(
            f"{where}.role must be one of user, system, developer, assistant", "input"
        )
    kept: list[str | ImageUrl] = []
    message: dict[str, Any] = {
        "role": mapped,
        "content": _content(item.get("content"), where, mapped, kept),
    }
    for at, image in enumerate(kept):  # checked here, in order: a refusal names its index
        try:
            if isinstance(image, ImageUrl):  # counted; checked once fetched
                kept[at] = images.later(image.url, image.where)
            else:
                images.take(base64.b64decode(image), f"{where}.content")
        except ProtocolError as exc:
            raise bad_request(exc.message, "input") from None
    if kept:
        message["images"] = kept
    return message


def input_urls(messages: Sequence[Message]) -> list[ImageUrl]:
    """The ``http(s)`` image URLs of parsed input items, in order (to fetch)."""
    return [
        image
        for message in messages
        for image in message.get("images", ())
        if isinstance(image, ImageUrl)
    ]


def with_fetched(messages: Sequence[Message], fetched: Mapping[int, bytes]) -> tuple[Message, ...]:
    """Parsed input items with each URL's image (``fetched``: bytes by image
    index) in its place as base64, as a ``data:`` URL's is kept."""
    out = []
    for message in messages:
        images = message.get("images")
        if images and any(isinstance(image, ImageUrl) for image in images):
            message = dict(message)
            message["images"] = [
                base64.b64encode(fetched[image.index]).decode()
                if isinstance(image, ImageUrl)
                else image
                for image in images
            ]
        out.append(message)
    return tuple(out)


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
        output = _content(output, f"{where}.output", "tool", [])
    elif not isinstance(output, str):
        raise bad_request(
            f"{where}.output must be a string or a list of 'input_text' parts", "input"
        )
    return {
        "role": "tool",
        "tool_call_id": _text_field(item, where, "call_id"),
        "content": output,
    }


def parse_function_tools(value: Any) -> tuple[Mapping[str, Any], ...]:
    """``tools``: function tools only, ``strict`` not true (the core checks the rest)."""
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


def _content(value: Any, where: str, role: str, images: list[str | ImageUrl]) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    allowed = ("output_text",) if role == "assistant" else ("input_text", "input_image")
    texts = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and role == "user" and isinstance(part, dict):
            images.append(_image_url(part.get("image_url"), f"{where}.content[{index}]"))
            texts.append(IMAGE_MARKER)
            continue
        if kind not in allowed or kind == "input_image":
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


def _image_url(url: Any, where: str) -> str | ImageUrl:
    """An ``input_image``'s base64, or its ``http(s)`` URL (to fetch; its
    index is given when its message counts it, in order)."""
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        return ImageUrl(url, -1, f"{where}.image_url")
    if not isinstance(url, str) or not url.startswith("data:"):
        raise bad_request(
            f"{where}.image_url: give a data: URL (data:image/png;base64,...) or an"
            " http(s) URL; file_id is not supported",
            "input",
        )
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise bad_request(f"{where}.image_url: expected data:image/...;base64,...", "input")
    try:
        base64.b64decode(payload, validate=True)
    except ValueError:
        raise bad_request(f"{where}.image_url: not valid base64", "input") from None
    return payload


def check_outputs(messages: Sequence[Message]) -> None:
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


def parse_choice(value: Any) -> Any:
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


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
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

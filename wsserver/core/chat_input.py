"""A chat request's input: messages, tools and template options, validated (sans-I/O).

The ``generate`` frame's ``messages`` are OpenAI's chat messages: roles
``system``, ``developer``, ``user``, ``assistant`` (which may carry
``tool_calls`` instead of text: ``content`` null, and the model's
``reasoning`` before its answer) and ``tool`` (a call's result, naming it by
``tool_call_id``). An assistant's reasoning goes to chat templates and
upstreams as ``reasoning_content``, llama.cpp's name: templates that know it
(Qwen 3's) show it for the turn in progress — the assistant messages after
the last user query, a tool-use loop's — and leave earlier turns' out.
``tools`` are OpenAI's function tools; ``chat_template_kwargs`` are extra
variables for the model's chat template (``enable_thinking``, say). An engine renders them (the llama
engine through the GGUF's template) or relays them; one that can do neither
refuses them (:data:`wsserver.core.sampling.NEUTRAL`).

Tools and template options are kept as canonical JSON text, as a
``json_schema`` is: the frames stay frozen and hashable, and an engine parses
them once, where it needs them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ..errors import ProtocolError
from .image_check import ImageUrl

__all__ = [
    "IMAGE_MARKER",
    "MAX_TOOLS",
    "RESERVED_TEMPLATE_NAMES",
    "ROLES",
    "Message",
    "ToolCall",
    "parse_messages",
    "parse_template_kwargs",
    "parse_tool_choice",
    "parse_tools",
]

#: Where an image goes in a message's text: libmtmd's default media marker.
#: A client's own text may not contain it (it would claim an image).
IMAGE_MARKER: Final = "<__media__>"
ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})
#: At most this many tools per request (OpenAI's limit).
MAX_TOOLS: Final = 128
#: A function's name, as OpenAI allows it.
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_CALL_ID_MAX: Final = 256
#: Variables a template gets from the server; ``chat_template_kwargs`` may not replace them.
RESERVED_TEMPLATE_NAMES: Final = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
    }
)

Fail = Callable[[str], ProtocolError]
#: Reads a message's ``images`` or ``audio`` (the value, where it stands, and
#: which of the two) into their bytes.
ReadImages = Callable[[Any, str, str], tuple[bytes, ...]]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call an assistant message made: ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message. ``content`` is "" when an assistant's is null."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    #: The call a ``tool`` message answers.
    tool_call_id: str | None = None
    #: OpenAI's optional participant (or, on a ``tool`` message, function) name.
    name: str | None = None
    #: An assistant's reasoning (its think block), None when it has none.
    reasoning: str | None = None
    #: The images of a user message, encoded (PNG, JPEG, GIF, BMP: checked,
    #: :mod:`.images`), each at an :data:`~.images.IMAGE_MARKER` in ``content``;
    #: its sounds (WAV, MP3, FLAC: :mod:`.audio_check`) are among them, at
    #: their markers, told apart by their bytes as libmtmd tells them.
    images: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)
    #: The ``http(s)`` image URLs among them, in order: each one's image is
    #: ``b""`` (no image is empty: that is refused) until the asyncio layer
    #: fetches it (:func:`~.images.fill_images`); never given to an engine.
    fetch: tuple[ImageUrl, ...] = ()

    def to_openai(self) -> dict[str, Any]:
        """The message in OpenAI's shape (what templates and upstreams read):
        the reasoning as ``reasoning_content``, llama.cpp's name."""
        out = self.to_frame()
        if self.reasoning is not None:
            out["reasoning_content"] = out.pop("reasoning")
        return out

    def to_frame(self) -> dict[str, Any]:
        """The message as the ``generate`` frame's ``messages`` take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            if not self.content:
                out["content"] = None
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        return out

    def size(self) -> int:
        """Characters of input this message carries (for the prompt limit)."""
        calls = sum(len(c.name) + len(c.arguments) for c in self.tool_calls)
        return len(self.content) + calls + len(self.reasoning or "")


_MESSAGE_KEYS: Final = frozenset(
    {"role", "content", "tool_calls", "tool_call_id", "name", "reasoning"}
)


def parse_messages(
    value: Any, *, max_messages: int, fail: Fail, images: ReadImages | None = None
) -> tuple[Message, ...]:
    """Validate a ``messages`` list (the caller checks the total size).

    With ``images``, a user message may carry ``images`` (the WebSocket
    protocol's): each goes before the message's text, in order (Ollama's
    place), at an :data:`IMAGE_MARKER`; a text that holds the marker itself
    is refused, in any message of a request with images."""
    if not isinstance(value, list) or not value:
        raise fail("'messages' must be a non-empty list")
    if len(value) > max_messages:
        raise fail(f"'messages' has more than {max_messages} entries")
    messages = tuple(
        _message(item, f"messages[{index}]", fail, images) for index, item in enumerate(value)
    )
    if any(m.images for m in messages):
        for index, message in enumerate(messages):
            if message.content.count(IMAGE_MARKER) != len(message.images):
                raise fail(
                    f"messages[{index}]: its text contains {IMAGE_MARKER!r}, which marks an "
                    "image's place here; remove it"
                )
    return messages


def _message(item: Any, where: str, fail: Fail, images: ReadImages | None) -> Message:
    allowed = _MESSAGE_KEYS if images is None else _MESSAGE_KEYS | {"images", "audio"}
    if not isinstance(item, dict) or "role" not in item or not set(item) <= allowed:
        raise fail(
            f"{where} must be an object with 'role' and 'content' "
            "(and, as OpenAI's, 'tool_calls', 'tool_call_id', 'name'; 'reasoning'"
            + ("; a user message's 'images' and 'audio')" if images is not None else ")")
        )
    role = item["role"]
    # isinstance first: ``in`` on a frozenset hashes, and a list is unhashable.
    if not isinstance(role, str) or role not in ROLES:
        raise fail(f"{where}.role must be one of system, developer, user, assistant, tool")
    calls: tuple[ToolCall, ...] = ()
    if item.get("tool_calls") is not None:
        if role != "assistant":
            raise fail(f"{where}.tool_calls: only an assistant message makes tool calls")
        calls = _tool_calls(item["tool_calls"], where, fail)
    content = item.get("content")
    if content is None and not calls:
        raise fail(f"{where}.content must be a string (null only beside 'tool_calls')")
    if content is not None and not isinstance(content, str):
        raise fail(f"{where}.content must be a string")
    call_id = item.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not 1 <= len(call_id) <= _CALL_ID_MAX:
            raise fail(f"{where}: a tool message needs 'tool_call_id', the call it answers")
    elif call_id is not None:
        raise fail(f"{where}.tool_call_id: only a tool message answers a call")
    name = item.get("name")
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 256):
        raise fail(f"{where}.name must be a string of 1 to 256 characters")
    reasoning = item.get("reasoning")
    if reasoning is not None:
        if role != "assistant":
            raise fail(f"{where}.reasoning: only an assistant message carries reasoning")
        if not isinstance(reasoning, str):
            raise fail(f"{where}.reasoning must be a string")
    read: tuple[bytes, ...] = ()
    for key in ("images", "audio"):  # images first, then sounds, before the text
        if images is not None and item.get(key) is not None:
            if role != "user":
                raise fail(f"{where}.{key}: only a user message carries {key}")
            read += images(item[key], f"{where}.{key}", key)
    text = IMAGE_MARKER * len(read) + (content or "")
    # "" is no reasoning: a template would show an empty think block for it.
    return Message(role, text, calls, call_id, name, reasoning or None, read)


def _tool_calls(value: Any, where: str, fail: Fail) -> tuple[ToolCall, ...]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise fail(f"{where}.tool_calls must be a list of at most {MAX_TOOLS} calls")
    calls = []
    for index, call in enumerate(value):
        here = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise fail(f"{here} must be {{'id', 'type': 'function', 'function': {{…}}}}")
        call_id, name = call.get("id"), function.get("name")
        arguments = function.get("arguments", "{}")
        if not isinstance(call_id, str) or not 1 <= len(call_id) <= _CALL_ID_MAX:
            raise fail(f"{here}.id must be a string of 1 to {_CALL_ID_MAX} characters")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise fail(f"{here}.function.name must be 1-64 characters of A-Z a-z 0-9 _ . : -")
        if not isinstance(arguments, str):
            raise fail(f"{here}.function.arguments must be a string (JSON text)")
        calls.append(ToolCall(call_id, name, arguments))
    return tuple(calls)


def parse_tools(value: Any, fail: Fail) -> str:
    """Validate ``tools`` (OpenAI's function tools); return them as canonical JSON text."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TOOLS:
        raise fail(f"'tools' must be a list of 1 to {MAX_TOOLS} tools")
    names = set()
    tools = []
    for index, tool in enumerate(value):
        here = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise fail(f"{here} must be {{'type': 'function', 'function': {{…}}}}")
        if not isinstance(function, dict):
            raise fail(f"{here}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise fail(f"{here}.function.name must be 1-64 characters of A-Z a-z 0-9 _ . : -")
        if name in names:
            raise fail(f"{here}.function.name: {name!r} is named twice")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise fail(f"{here}.function.description must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise fail(f"{here}.function.parameters must be a JSON Schema object")
        kind = parameters.get("type", "object")
        if kind != "object":
            raise fail(f"{here}.function.parameters must describe an object (type: object)")
        if not isinstance(parameters.get("properties", {}), dict):
            raise fail(f"{here}.function.parameters.properties must be an object")
        required = parameters.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise fail(f"{here}.function.parameters.required must be a list of names")
        problem = schema_problem(parameters, f"{here}.function.parameters")
        if problem is not None:
            raise fail(problem)
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise fail(f"{here}.function.strict must be a boolean")
        entry: dict[str, Any] = {"name": name}
        if description is not None:
            entry["description"] = description
        entry["parameters"] = parameters
        tools.append({"type": "function", "function": entry})
    return orjson.dumps(tools).decode()


_SCHEMA_TYPES: Final = frozenset(
    {"object", "array", "string", "number", "integer", "boolean", "null"}
)
#: Keywords whose value is a schema, a map of schemas, a list of schemas.
_ONE_SCHEMA: Final = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SCHEMA_MAPS: Final = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS: Final = ("anyOf", "oneOf", "allOf", "prefixItems")


def schema_problem(schema: Any, where: str, depth: int = 0) -> str | None:
    """What makes ``schema`` not a JSON Schema, in the keywords that shape a
    value (``type``, the subschemas, ``required``, ``enum``), or None.

    Not a full meta-schema check: the keywords every engine reads, so that a
    typo such as ``"type": "integr"`` is a ``bad_request`` naming its place
    whichever engine serves the request, not a schema the model is shown."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be a JSON Schema (an object or a boolean)"
    if depth > 32:
        return f"{where}: the schema nests deeper than 32 levels"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in _SCHEMA_TYPES for k in kinds):
        return f"{where}.type must be one of {', '.join(sorted(_SCHEMA_TYPES))} (or a list of them)"
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        return f"{where}.required must be a list of names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}.enum must be a list"
    for key in _ONE_SCHEMA:
        if key in schema and not (key == "items" and isinstance(schema[key], list)):
            found = schema_problem(schema[key], f"{where}.{key}", depth + 1)
            if found is not None:
                return found
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if children is None:
            continue
        if not isinstance(children, dict):
            return f"{where}.{key} must be an object of schemas"
        for name, child in children.items():
            found = schema_problem(child, f"{where}.{key}.{name}", depth + 1)
            if found is not None:
                return found
    for key in _SCHEMA_LISTS:
        children = schema.get(key)
        if children is None:
            continue
        if not isinstance(children, list) or not children:
            return f"{where}.{key} must be a non-empty list of schemas"
        for index, child in enumerate(children):
            found = schema_problem(child, f"{where}.{key}[{index}]", depth + 1)
            if found is not None:
                return found
    return None


def parse_tool_choice(obj: dict[str, Any], tools: str | None, fail: Fail) -> dict[str, Any]:
    """``tool_choice`` and ``parallel_tool_calls`` of ``obj`` (only with ``tools``):
    the Generate fields ``tool_choice``, ``tool_name``, ``parallel_tool_calls``."""
    out: dict[str, Any] = {}
    for field in ("tool_choice", "parallel_tool_calls"):
        if field in obj and tools is None:
            raise fail(f"'{field}' needs 'tools'")
    if "parallel_tool_calls" in obj:
        if not isinstance(obj["parallel_tool_calls"], bool):
            raise fail("'parallel_tool_calls' must be a boolean")
        out["parallel_tool_calls"] = obj["parallel_tool_calls"]
    if "tool_choice" not in obj:
        return out
    choice = obj["tool_choice"]
    if choice in ("auto", "none", "required"):
        out["tool_choice"] = choice
        return out
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise fail(
            '\'tool_choice\' must be "auto", "none", "required" or '
            "{'type': 'function', 'function': {'name': …}}"
        )
    names = {tool["function"]["name"] for tool in orjson.loads(tools or "[]")}
    if name not in names:
        raise fail(f"'tool_choice' names {name[:64]!r}, which is not one of 'tools'")
    out.update(tool_choice="required", tool_name=name)
    return out


def parse_template_kwargs(value: Any, fail: Fail) -> str:
    """Validate ``chat_template_kwargs``; return them as JSON text."""
    if not isinstance(value, dict):
        raise fail("'chat_template_kwargs' must be an object")
    for key in value:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key):
            raise fail(f"chat_template_kwargs: {key[:40]!r} is not a template variable name")
        if key in RESERVED_TEMPLATE_NAMES:
            raise fail(f"chat_template_kwargs: {key!r} is set by the server")
    return orjson.dumps(value).decode()

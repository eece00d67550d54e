"""Anthropic's content blocks, tools and thinking, mapped onto the core's chat (sans-I/O).

The Messages API says in blocks what the core's chat (:mod:`wsserver.core.chat_input`,
OpenAI's chat shape) says in messages; this module translates one into the
other and checks every block, naming it Anthropic's way
(``messages.2.content.0.tool_use_id``):

* ``text`` — text; the blocks of a message are joined, consecutive messages
  of one role are combined into one turn (as Anthropic does), their texts
  separated by a blank line;
* ``tool_use`` (assistant) — one of the turn's ``tool_calls``: its ``id``,
  ``name`` and ``input`` (an object, passed on as JSON text);
* ``tool_result`` (user) — a ``tool`` message answering a ``tool_use`` of the
  previous assistant turn (any other id is refused): its ``content`` a string
  or text blocks; with ``is_error`` the text is prefixed ``Error: `` (the
  chat shape has no error flag, and the model should know). A user turn's
  tool results come first, then its text as a user message;
* ``thinking`` (assistant) — the turn's reasoning (the blocks of a turn
  joined by a blank line) **only in the tool-use loop in progress**: the
  assistant turns after the last user turn that carries text (the ones its
  ``tool_result`` blocks answer), as Anthropic keeps that thinking in the
  context and leaves earlier turns' out; earlier turns' are accepted and
  dropped. ``redacted_thinking`` (encrypted, unreadable here) is always
  dropped; nothing checks a ``signature``;
* ``image`` (user) — an image, its ``source`` ``base64``, or ``url`` (an
  ``http(s)`` URL is fetched behind the operator's allow-list, off by
  default: docs/images.md), checked from its header
  (:mod:`wsserver.core.images`: refusals name the image's index in the
  request), in the text at its place;
* anything else (documents, server tools' blocks) is refused.

``tools`` become the core's function tools (``input_schema`` as
``parameters``, checked to describe an object); ``tool_choice`` becomes the
core's ``tool_choice`` — ``auto``, ``none``, ``any`` as ``required``, a named
``tool`` as ``required`` with ``tool_name`` (the fields every dialect gives,
so an engine that can force a call honours them all at once; one that cannot
refuses them) — and ``disable_parallel_tool_use`` its ``parallel_tool_calls``.
``thinking`` becomes the core's ``reasoning_format``: ``enabled`` is
``auto`` (a think block the model writes is split off and answered as
``thinking`` blocks), ``disabled`` is ``none`` (the text as the model wrote
it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final

import orjson

from ...core.chat_input import MAX_TOOLS, Message, ToolCall
from ...core.images import IMAGE_MARKER, ImageBudget, ImageUrl, with_urls
from ...errors import ProtocolError
from ..api_errors import ApiError

__all__ = [
    "ERROR_PREFIX",
    "bad_request",
    "forced_call_refusal",
    "parse_messages",
    "parse_thinking",
    "parse_tool_choice",
    "parse_tools",
    "text_of",
]

#: What starts a tool result's text when the tool failed (``is_error``).
ERROR_PREFIX: Final = "Error: "

_ROLES: Final = frozenset({"user", "assistant"})
_TEXT_BLOCK_KEYS: Final = frozenset({"type", "text", "cache_control", "citations"})
_TOOL_USE_KEYS: Final = frozenset({"type", "id", "name", "input", "cache_control"})
_TOOL_RESULT_KEYS: Final = frozenset(
    {"type", "tool_use_id", "content", "is_error", "cache_control"}
)
_TOOL_KEYS: Final = frozenset({"type", "name", "description", "input_schema", "cache_control"})
#: A tool's name, as the core's chat allows it (Anthropic's rule is narrower).
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_ID_MAX: Final = 256


def bad_request(message: str, param: str | None = None, code: str = "bad_request") -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, code, param)


def _refused(message: str, param: str) -> ApiError:
    return bad_request(message, param, "unsupported_parameter")


# ---------------------------------------------------------------- messages


@dataclass(slots=True)
class _Turn:
    """Consecutive messages of one role, combined."""

    role: str
    texts: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    results: list[Message] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    images: list[bytes | ImageUrl] = field(default_factory=list)

    def messages(self, *, keep_thinking: bool) -> list[Message]:
        text = "\n\n".join(self.texts)
        if self.role == "assistant":
            reasoning = "\n\n".join(self.thinking) if keep_thinking else ""
            return [Message("assistant", text, tuple(self.calls), reasoning=reasoning or None)]
        tail = (
            [with_urls(Message("user", text), self.images)]
            if self.texts or not self.results
            else []
        )
        return [*self.results, *tail]


def parse_messages(value: Any) -> tuple[Message, ...]:
    """``messages`` as the core's chat messages (the last one a user's)."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages: must be a non-empty list", "messages")
    turns: list[_Turn] = []
    images = ImageBudget(lambda message: ProtocolError("bad_request", message))
    for index, item in enumerate(value):
        where = f"messages.{index}"
        if not isinstance(item, dict) or not {"role", "content"} <= set(item) or len(item) > 2:
            raise bad_request(f"{where}: must be an object with 'role' and 'content'", "messages")
        role = item["role"]
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"{where}.role: must be 'user' or 'assistant'", "messages")
        if not turns or turns[-1].role != role:
            turns.append(_Turn(role))
        turn = turns[-1]
        content = item["content"]
        if isinstance(content, str):
            turn.texts.append(content)
        elif isinstance(content, list):
            calls = turns[-2].calls if len(turns) > 1 else []
            _blocks(content, f"{where}.content", turn, {call.id for call in calls}, images)
        else:
            raise bad_request(f"{where}.content: must be a string or a list of blocks", "messages")
    if turns[-1].role == "assistant":
        raise bad_request(
            f"messages.{len(value) - 1}: a last assistant turn (prefill, continued by the"
            " answer) is not supported yet; end with a user turn",
            "messages",
        )
    # The tool-use loop in progress starts after the last user turn with text:
    # its assistant turns keep their thinking, earlier turns' is dropped.
    start = max(
        (i for i, turn in enumerate(turns) if turn.role == "user" and turn.texts), default=-1
    )
    return tuple(
        message
        for index, turn in enumerate(turns)
        for message in turn.messages(keep_thinking=index > start)
    )


def _blocks(
    blocks: list[Any], where: str, turn: _Turn, answerable: set[str], images: ImageBudget
) -> None:
    texts = []
    for index, block in enumerate(blocks):
        at = f"{where}.{index}"
        if not isinstance(block, dict):
            raise bad_request(f"{at}: must be a content block (an object)", "messages")
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at, "messages"))
        elif kind == "tool_use" and turn.role == "assistant":
            turn.calls.append(_tool_use(block, at))
        elif kind == "tool_result" and turn.role == "user":
            turn.results.append(_tool_result(block, at, answerable))
        elif kind == "image" and turn.role == "user":
            turn.images.append(_image(block, at, images))
            texts.append(IMAGE_MARKER)
        elif kind in ("thinking", "redacted_thinking") and turn.role == "assistant":
            thinking = _thinking_block(block, at)
            if thinking:
                turn.thinking.append(thinking)
        elif kind in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
            raise bad_request(
                f"{at}.type: a {kind!r} block does not belong in a {turn.role} message",
                "messages",
            )
        else:
            raise _unsupported_block(kind, at, "messages")
    if texts:
        turn.texts.append("".join(texts))


def _unsupported_block(kind: Any, at: str, param: str) -> ApiError:
    what = "images here" if kind == "image" else f"blocks of type {str(kind)[:40]!r}"
    return bad_request(
        f"{at}.type: {what} are not supported (text, tool_use, tool_result and thinking"
        " are, and a user's image blocks)",
        param,
    )


def _image(block: dict[str, Any], at: str, images: ImageBudget) -> bytes | ImageUrl:
    """An ``image`` block's bytes (a ``base64`` source), or its ``url`` source's
    URL: an ``http(s)`` one is fetched before the request runs, behind the
    operator's allow-list (:mod:`wsserver.aio.image_fetch`)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    try:
        if kind == "url" and isinstance(source, dict):
            return images.url_or_data(source.get("url"), f"{at}.source")
        if kind != "base64" or not isinstance(source, dict):
            raise images.fail(
                f"image {images.count} ({at}.source): give a base64 source "
                "({'type': 'base64', 'media_type': 'image/png', 'data': ...})"
            )
        return images.from_base64(source.get("data"), f"{at}.source")
    except ProtocolError as exc:
        raise bad_request(exc.message, "messages") from None


def _text(block: dict[str, Any], at: str, param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{at}.text: must be a string", param)
    for key, item in block.items():
        if key not in _TEXT_BLOCK_KEYS or (key == "citations" and item):
            raise bad_request(f"{at}.{key}: not supported", param)
    return text


def text_of(blocks: list[Any], where: str, param: str) -> str:
    """The text of a list of ``text`` blocks (``system``, a tool result's content)."""
    texts = []
    for index, block in enumerate(blocks):
        at = f"{where}.{index}"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise _unsupported_block(kind, at, param)
        texts.append(_text(block, at, param))
    return "".join(texts)


def _unknown_keys(block: dict[str, Any], allowed: frozenset[str], at: str) -> None:
    for key in block:
        if key not in allowed:
            raise bad_request(f"{at}.{str(key)[:40]}: unknown field", "messages")


def _tool_use(block: dict[str, Any], at: str) -> ToolCall:
    # What the SDK's own ToolUseBlock echoes when a response's block is sent
    # back: a direct call (``caller``) and no toolset — nothing else is accepted.
    if block.get("caller") in (None, {"type": "direct"}) and block.get("toolset_name") is None:
        block = {k: v for k, v in block.items() if k not in ("caller", "toolset_name")}
    _unknown_keys(block, _TOOL_USE_KEYS, at)
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= _ID_MAX:
        raise bad_request(f"{at}.id: must be a string of 1 to {_ID_MAX} characters", "messages")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise bad_request(f"{at}.name: must be 1-64 characters of A-Z a-z 0-9 _ . : -", "messages")
    if not isinstance(arguments, dict):
        raise bad_request(f"{at}.input: must be an object", "messages")
    return ToolCall(call_id, name, orjson.dumps(arguments).decode())


def _tool_result(block: dict[str, Any], at: str, answerable: set[str]) -> Message:
    _unknown_keys(block, _TOOL_RESULT_KEYS, at)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.tool_use_id: must be a string", "messages")
    if call_id not in answerable:
        raise bad_request(
            f"{at}.tool_use_id: {call_id[:64]!r} answers no tool_use block of the previous"
            " assistant message",
            "messages",
        )
    content = block.get("content", "")
    if isinstance(content, list):
        content = text_of(content, f"{at}.content", "messages")
    elif not isinstance(content, str):
        raise bad_request(f"{at}.content: must be a string or a list of text blocks", "messages")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad_request(f"{at}.is_error: must be a boolean", "messages")
    return Message("tool", ERROR_PREFIX + content if is_error else content, tool_call_id=call_id)


def _thinking_block(block: dict[str, Any], at: str) -> str | None:
    """A ``thinking`` block's text; None for ``redacted_thinking`` (encrypted)."""
    name = "thinking" if block["type"] == "thinking" else "data"
    value = block.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{at}.{name}: must be a string", "messages")
    return value if name == "thinking" else None


# ---------------------------------------------------------------- tools


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """``tools`` as the core's function tools (``None`` for none)."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"tools: must be a list of at most {MAX_TOOLS} tools", "tools")
    names: set[str] = set()
    tools = []
    for index, tool in enumerate(value):
        at = f"tools.{index}"
        if not isinstance(tool, dict):
            raise bad_request(f"{at}: must be an object", "tools")
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise _refused(
                f"{at}.type: server tools ({str(kind)[:60]!r}) are not supported; only"
                " custom tools (name, description, input_schema)",
                "tools",
            )
        for key in tool:
            if key not in _TOOL_KEYS:
                raise bad_request(f"{at}.{str(key)[:40]}: unknown field", "tools")
        name = tool.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise bad_request(f"{at}.name: must be 1-64 characters of A-Z a-z 0-9 _ . : -", "tools")
        if name in names:
            raise bad_request(f"{at}.name: {name!r} is named twice", "tools")
        names.add(name)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{at}.description: must be a string", "tools")
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        function["parameters"] = _input_schema(tool.get("input_schema"), f"{at}.input_schema")
        tools.append({"type": "function", "function": function})
    return tools or None


def _input_schema(schema: Any, at: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise bad_request(f"{at}: must be a JSON Schema object", "tools")
    if schema.get("type") != "object":
        raise bad_request(f"{at}.type: must be 'object' (a tool's input is an object)", "tools")
    if not isinstance(schema.get("properties", {}), dict):
        raise bad_request(f"{at}.properties: must be an object", "tools")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad_request(f"{at}.required: must be a list of property names", "tools")
    return schema


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """``tool_choice`` as the ``generate`` frame's ``tool_choice`` and
    ``parallel_tool_calls`` (only with tools: without, ``auto`` and ``none``
    change nothing and a forced call is refused)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request(
            "tool_choice: must be {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice"
        )
    assert isinstance(value, dict)
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    for key in value:
        if key not in allowed:
            raise bad_request(f"tool_choice.{str(key)[:40]}: unknown field", "tool_choice")
    disable_parallel = value.get("disable_parallel_tool_use")
    if disable_parallel is not None and not isinstance(disable_parallel, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use: must be a boolean", "tool_choice")
    if tools is None:
        if kind in ("any", "tool"):
            raise bad_request(f"tool_choice: {kind!r} needs tools", "tool_choice")
        return {}
    out: dict[str, Any] = {}
    if disable_parallel is not None:
        out["parallel_tool_calls"] = not disable_parallel
    if kind == "tool":
        name = value.get("name")
        names = {tool["function"]["name"] for tool in tools}
        if not isinstance(name, str) or name not in names:
            raise bad_request("tool_choice.name: must name one of the tools", "tool_choice")
        # The protocol's named choice (its parser makes it ``required`` + ``tool_name``).
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"any": "required"}.get(kind, kind)
    return out


def forced_call_refusal(engine: str) -> ApiError:
    """An engine that cannot force a call, asked to (``any`` or a named tool)."""
    return _refused(
        "tool_choice: {'type': 'any'} and {'type': 'tool'} (a forced call) are not supported"
        f" by this server's engine ({engine}) yet; give {{'type': 'auto'}} or"
        " {'type': 'none'}",
        "tool_choice",
    )


# ---------------------------------------------------------------- thinking


def parse_thinking(value: Any, max_tokens: int | None) -> str:
    """``thinking`` as the core's ``reasoning_format``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled" and len(value) == 1:
        return "none"
    if kind != "enabled":
        raise bad_request(
            "thinking: must be {'type': 'enabled', 'budget_tokens': n} or {'type': 'disabled'}",
            "thinking",
        )
    assert isinstance(value, dict)
    for key in value:
        if key not in ("type", "budget_tokens"):
            raise bad_request(f"thinking.{str(key)[:40]}: unknown field", "thinking")
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise bad_request("thinking.budget_tokens: must be an integer >= 1", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request("thinking.budget_tokens: must be less than max_tokens", "thinking")
    return "auto"

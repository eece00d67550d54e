"""Ollama's ``/api/chat`` and ``/api/generate`` bodies, and its error object (sans-I/O).

A body becomes an :class:`OllamaRequest` (:func:`parse_chat`,
:func:`parse_generate`) holding one :class:`~wsserver.core.protocol.Generate`,
validated by the WebSocket protocol's own parser: an Ollama request meets the
same limits as every other, its fields named Ollama's way in the errors
(``options.temperature``, ``format``, ``think``).

**Honour or refuse, never ignore.** Every top-level field is honoured, or
accepted only with a value that asks for nothing, or refused naming it
(:data:`CHAT_FIELDS`, :data:`GENERATE_FIELDS`): ``suffix`` (no fill-in-the-middle), ``template`` (a
model's chat template is its own), the deprecated ``context``, ``truncate``
and ``shift`` ``true`` (nothing here drops a conversation's start; a prompt
beyond the context is refused), image generation's ``width``, ``height``,
``steps``. ``options``, ``format``, ``think`` and ``keep_alive`` are
:mod:`wsserver.dialects.ollama.options`'. Any other field is unknown, and refused.

**Images.** A user message's ``images`` (``/api/generate``'s, with a
``prompt`` that is not ``raw``), base64, are checked from their headers
(:mod:`wsserver.core.images`: refusals name the image's index in the
request) and go before the message's text, in order.

**Messages.** Roles ``system``, ``user``, ``assistant`` and ``tool``; an
assistant's ``thinking`` is its reasoning, its ``tool_calls``
(``{"function": {"name", "arguments": {…}}}``, an ``id`` optional) the core's
calls — a call without an ``id`` gets ``call_<turn>_<n>``; a ``tool``
message answers the call its ``tool_call_id`` names, else the first call of
its ``tool_name`` not answered yet, else the next one not answered (Ollama's
clients send the name, or nothing).

**A request with nothing to answer** — ``/api/chat`` without ``messages``,
``/api/generate`` without ``prompt`` — loads the model, or with
``keep_alive`` 0 unloads it, as Ollama does (:attr:`OllamaRequest.generate`
is None; ``done_reason`` ``load`` or ``unload``).

**Errors** are Ollama's ``{"error": "message"}`` (:func:`error_body`), with
the :class:`~wsserver.dialects.api_errors.ApiError`'s status.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from ...core.images import IMAGE_MARKER, ImageBudget, with_images
from ...core.protocol import Generate, Limits, parse_client_frame
from ...errors import ProtocolError
from ..api_errors import ApiError, in_dialect_names
from .options import (
    SAMPLER,
    bad_request,
    parse_format,
    parse_keep_alive,
    parse_options,
    parse_think,
)

__all__ = [
    "CHAT_FIELDS",
    "GENERATE_FIELDS",
    "Kind",
    "OllamaRequest",
    "error_body",
    "error_object",
    "parse_chat",
    "parse_generate",
    "refusal_wording",
]

Kind = Literal["chat", "generate"]

#: Top-level fields of each endpoint that are honoured (or checked to ask for nothing).
CHAT_FIELDS: Final = frozenset(
    {
        "model",
        "messages",
        "tools",
        "think",
        "format",
        "options",
        "stream",
        "keep_alive",
        "logprobs",
        "top_logprobs",
        "truncate",
        "shift",
    }
)
GENERATE_FIELDS: Final = frozenset(
    {
        "model",
        "prompt",
        "suffix",
        "system",
        "template",
        "context",
        "raw",
        "images",
        "think",
        "format",
        "options",
        "stream",
        "keep_alive",
        "logprobs",
        "top_logprobs",
        "truncate",
        "shift",
    }
)
#: Fields refused with a reason whatever their value (when given a non-empty one).
_REFUSED: Final = {
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "template": "a custom template is not supported: a model answers with its own chat template",
    "context": (
        "the deprecated 'context' (token ids of an earlier answer) is not supported;"
        " send the conversation to /api/chat instead"
    ),
    "width": "image generation is not supported",
    "height": "image generation is not supported",
    "steps": "image generation is not supported",
}

_MESSAGE_KEYS: Final = frozenset(
    {"role", "content", "images", "tool_calls", "thinking", "tool_name", "tool_call_id"}
)
_ROLES: Final = ("system", "user", "assistant", "tool")

#: The core's field names in its messages → Ollama's.
_NAMES: Final = {
    **{core: f"options.{ollama}" for ollama, core in SAMPLER.items()},
    "json_schema": "format",
    "reasoning_budget_tokens": "think",
    "reasoning_format": "think",
}


@dataclass(frozen=True, slots=True)
class OllamaRequest:
    """A validated ``/api/chat`` or ``/api/generate`` request."""

    kind: Kind
    #: The model as the client named it (answers echo it; the route resolves it).
    model: str
    #: What to run; None: nothing to answer (load the model, or unload it).
    generate: Generate | None
    stream: bool = True
    #: Seconds (the core's): 0 unloads once idle, -1 until its memory is needed.
    keep_alive: float | None = None
    #: ``options.num_ctx``, for the route to check against the model.
    num_ctx: int | None = None
    #: ``logprobs`` asked for: each object carries its tokens'.
    logprobs: bool = False


# ---------------------------------------------------------------- errors


def error_object(message: str) -> dict[str, Any]:
    """Ollama's error object."""
    return {"error": message}


def error_body(error: ApiError) -> tuple[int, bytes]:
    """An :class:`ApiError` as Ollama answers it: its status, ``{"error": message}``."""
    return error.status, orjson.dumps(error_object(error.message))


def refusal_wording(message: str) -> str:
    """An engine's refusal in Ollama's names (``'json_schema'`` is ``'format'``)."""
    return in_dialect_names(message, _NAMES)


# ---------------------------------------------------------------- bodies


def parse_chat(obj: Mapping[str, Any], request_id: str, limits: Limits) -> OllamaRequest:
    """An ``/api/chat`` body."""
    given = _given(obj, CHAT_FIELDS)
    frame: dict[str, Any] = {}
    images = _Images()
    if given.get("messages"):
        frame["messages"] = _messages(given["messages"], limits, images)
    if "tools" in given:
        if not isinstance(given["tools"], list):
            raise bad_request("tools: must be a list of function tools")
        if given["tools"]:  # [] is no tools (clients send it)
            frame["tools"] = [_tool(tool) for tool in given["tools"]]
    frame.update(parse_think(given.get("think")))
    return _request("chat", given, frame, request_id, limits, images)


def parse_generate(obj: Mapping[str, Any], request_id: str, limits: Limits) -> OllamaRequest:
    """An ``/api/generate`` body: ``raw`` sends ``prompt`` as it is; else
    ``system`` and ``prompt`` are a chat the model's template renders."""
    given = _given(obj, GENERATE_FIELDS)
    raw = given.get("raw", False)
    if not isinstance(raw, bool):
        raise bad_request("raw: must be true or false")
    prompt = given.get("prompt", "")
    system = given.get("system", "")
    for name, value in (("prompt", prompt), ("system", system)):
        if not isinstance(value, str):
            raise bad_request(f"{name}: must be a string")
    frame: dict[str, Any] = {}
    images = _Images()
    if raw:
        if given.get("images"):
            raise bad_request("images: not with raw (a raw prompt is sent as it is)")
        if system:
            raise bad_request("system: not with raw (a raw prompt is sent as it is)")
        if "think" in given:
            raise bad_request("think: not with raw (thinking is the chat template's)")
        if prompt:
            frame["prompt"] = prompt
    else:
        if prompt:
            messages = [{"role": "system", "content": system}] if system else []
            content = images.take(given.get("images"), len(messages), "images") + prompt
            frame["messages"] = [*messages, {"role": "user", "content": content}]
        elif given.get("images"):
            raise bad_request("images: give a prompt with them")
        frame.update(parse_think(given.get("think")))
    return _request("generate", given, frame, request_id, limits, images)


def _given(obj: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """The fields given (``null`` is not given), each known and not refused."""
    given = {key: value for key, value in obj.items() if value is not None}
    for name, value in given.items():
        if name in _REFUSED:
            if value in ("", [], {}, 0):
                continue  # what clients send for "none"
            raise bad_request(f"{name}: {_REFUSED[name]}", "unsupported_option")
        if name in ("truncate", "shift"):
            if value is not False:
                raise bad_request(
                    f"{name}: only false is accepted (nothing here drops the start of a"
                    " conversation or of an answer; a prompt beyond the context is refused)",
                    "unsupported_option",
                )
            continue
        if name not in known:
            raise bad_request(f"{str(name)[:64]}: unknown field", "unsupported_option")
    return given


class _Images:
    """A request's images as its messages are read: checked, by message index."""

    def __init__(self) -> None:
        self.budget = ImageBudget(lambda message: ProtocolError("bad_request", message))
        self.by_message: dict[int, list[bytes]] = {}

    def take(self, value: Any, index: int, where: str) -> str:
        """A message's ``images`` (base64 strings) kept; their markers."""
        if not value:
            return ""
        if not isinstance(value, list):
            raise bad_request(f"{where}: must be a list of base64 images")
        kept = self.by_message.setdefault(index, [])
        for item in value:
            try:
                kept.append(self.budget.from_base64(item, where))
            except ProtocolError as exc:
                raise bad_request(exc.message) from None
        return IMAGE_MARKER * len(value)


def _request(
    kind: Kind,
    given: dict[str, Any],
    frame: dict[str, Any],
    request_id: str,
    limits: Limits,
    images: _Images,
) -> OllamaRequest:
    model = given.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required")
    stream = given.get("stream", True)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be true or false")
    keep_alive = parse_keep_alive(given.get("keep_alive"))
    options, num_ctx = parse_options(given.get("options", {}), limits.max_tokens)
    frame.update(options)
    schema = parse_format(given.get("format"))
    if schema is not None:
        frame["json_schema"] = schema
    logprobs = given.get("logprobs", False)
    if logprobs is not False:
        frame["logprobs"] = logprobs
    if "top_logprobs" in given:
        frame["top_logprobs"] = given["top_logprobs"]
    if "prompt" not in frame and "messages" not in frame:
        # Nothing to answer: load the model (or unload it), as Ollama does.
        return OllamaRequest(kind, model, None, stream, keep_alive, num_ctx)
    frame.setdefault("max_tokens", limits.max_tokens)  # Ollama's default: no limit
    frame.update(type="generate", id=request_id)
    if keep_alive is not None:
        frame["keep_alive"] = keep_alive
    try:
        generate = parse_client_frame(orjson.dumps(frame).decode(), limits)
        assert isinstance(generate, Generate)
        if images.by_message and generate.messages is not None:
            messages = with_images(generate.messages, images.by_message, images.budget.fail)
            generate = dataclasses.replace(generate, messages=messages)
    except ProtocolError as exc:
        error = ApiError.from_protocol(exc)
        error.message = refusal_wording(error.message)
        raise error from None
    return OllamaRequest(
        kind, model, generate, stream, keep_alive, num_ctx, logprobs=logprobs is True
    )


def _tool(tool: Any) -> Any:
    """A tool as the frame takes it (OpenAI's function tools, which Ollama's are)."""
    if isinstance(tool, dict) and "type" not in tool and "function" in tool:
        return {"type": "function", **tool}
    return tool


def _messages(value: Any, limits: Limits, images: _Images) -> list[dict[str, Any]]:
    """``messages`` as the frame's (OpenAI's chat shape); see the module docstring."""
    if not isinstance(value, list):
        raise bad_request("messages: must be a list")
    if len(value) > limits.max_messages:
        raise bad_request(f"messages: more than {limits.max_messages} messages")
    out: list[dict[str, Any]] = []
    #: The last assistant turn's calls not answered yet: (id, name).
    open_calls: list[tuple[str, str]] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where}: must be an object")
        for key in message:
            if key not in _MESSAGE_KEYS:
                raise bad_request(f"{where}.{str(key)[:64]}: unknown field")
        role = message.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role: must be one of {', '.join(_ROLES)}")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"{where}.content: must be a string")
        content = images.take(message.get("images"), index, f"{where}.images") + content
        entry: dict[str, Any] = {"role": role, "content": content}
        thinking = message.get("thinking")
        if thinking:
            if role != "assistant":
                raise bad_request(f"{where}.thinking: only an assistant message has thinking")
            if not isinstance(thinking, str):
                raise bad_request(f"{where}.thinking: must be a string")
            entry["reasoning"] = thinking
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant":
                raise bad_request(f"{where}.tool_calls: only an assistant message makes calls")
            entry["tool_calls"] = _tool_calls(calls, index, where)
            open_calls = [(c["id"], c["function"]["name"]) for c in entry["tool_calls"]]
        elif role == "assistant":
            open_calls = []
        if role == "tool":
            entry["tool_call_id"] = _answered(message, open_calls, index, where)
            name = message.get("tool_name")
            if name is not None:
                if not isinstance(name, str) or not name:
                    raise bad_request(f"{where}.tool_name: must be a non-empty string")
                entry["name"] = name
        elif message.get("tool_name") is not None or message.get("tool_call_id") is not None:
            raise bad_request(f"{where}: only a tool message names a call")
        out.append(entry)
    return out


def _tool_calls(value: Any, turn: int, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request(f"{where}.tool_calls: must be a list")
    calls = []
    for number, call in enumerate(value):
        here = f"{where}.tool_calls[{number}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad_request(f"{here}: must be {{'function': {{'name', 'arguments'}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{here}.function.name: must be a non-empty string")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            text = arguments  # JSON text, as OpenAI's shape has it
        elif isinstance(arguments, dict):
            text = orjson.dumps(arguments).decode()
        else:
            raise bad_request(f"{here}.function.arguments: must be an object")
        call_id = call.get("id") or f"call_{turn}_{number}"
        if not isinstance(call_id, str):
            raise bad_request(f"{here}.id: must be a string")
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}
        )
    return calls


def _answered(
    message: dict[str, Any], open_calls: list[tuple[str, str]], turn: int, where: str
) -> str:
    """The call a ``tool`` message answers (removed from ``open_calls``)."""
    given = message.get("tool_call_id")
    if given is not None:
        if not isinstance(given, str) or not given:
            raise bad_request(f"{where}.tool_call_id: must be a non-empty string")
        open_calls[:] = [c for c in open_calls if c[0] != given]
        return given
    name = message.get("tool_name")
    for at, (call_id, call_name) in enumerate(open_calls):
        if name is None or call_name == name:
            del open_calls[at]
            return call_id
    # A result no call of the conversation asked for: the template shows it as such.
    return f"call_{turn}_result"

"""The OpenAI HTTP API's request bodies, without the I/O (sans-I/O).

Bodies in, :class:`~wsserver.core.protocol.Generate` out; the answers (``delta``
and ``done`` frames in, OpenAI's JSON objects and Server-Sent Events out) are
:mod:`wsserver.dialects.openai.render`'s.

A ``/v1/chat/completions`` or ``/v1/completions`` body is mapped onto the
WebSocket protocol's ``generate`` frame and validated by the very same
parser (:func:`~wsserver.core.protocol.parse_client_frame`), so an HTTP request
meets the same limits, with the same messages, as a WebSocket one. What the
protocol does not know is dealt with here: OpenAI's names
(``max_completion_tokens``), content given as a list of text parts, the
``developer`` role, an assistant's ``reasoning_content`` (the frame's
``reasoning``), ``n`` (several choices: the frame's ``n``, at most
:data:`~wsserver.core.sampling.MAX_CHOICES` and the model's ``parallel`` at the exchange),
``stream`` and ``stream_options``,
completions' legacy ``logprobs`` (a count; chat's ``logprobs`` and
``top_logprobs`` are the frame's own). The
sampler options (``presence_penalty``, ``frequency_penalty``, ``logit_bias``
and llama-server's ``min_p``, ``repeat_penalty``, DRY, XTC, …) go to the frame
under the same names. ``null`` means "not given", as in OpenAI's own API.

Every refusal is an :class:`ApiError` (:mod:`wsserver.dialects.api_errors`, shared
with the Responses API) with its HTTP status and OpenAI's error
object (``{"error": {"message", "type", "param", "code"}}``); ``code`` is the
wire code a WebSocket client would get for the same fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final, Literal

import orjson

from ...core.audio_check import AUDIO_FORMATS, audio_format
from ...core.images import IMAGE_MARKER, ImageBudget, ImageUrl, with_images
from ...core.models import ModelInfo
from ...core.protocol import Generate, Limits, parse_client_frame
from ...core.sampling import MAX_CHOICES, MAX_TOP_LOGPROBS, SAMPLING_FIELDS
from ...errors import ProtocolError
from ..api_errors import ApiError, error_body, parse_json, status_of

__all__ = [
    "ApiError",
    "ApiRequest",
    "Kind",
    "error_body",
    "models_body",
    "parse_request",
    "status_of",
]

Kind = Literal["chat", "completion"]

_ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def model_entry(model: ModelInfo) -> dict[str, Any]:
    """One model object: OpenAI's members, then its state and limits."""
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "wsserver",
        "state": model.state,
        "n_ctx": model.n_ctx,
        "parallel": model.parallel,
        "max_waiting": model.max_waiting,
        "aliases": list(model.aliases),
        **({"embeddings": model.embeddings} if model.embeddings is not None else {}),
        **(
            {"input_modalities": list(model.input_modalities)}
            if model.input_modalities is not None
            else {}
        ),
    }


def models_body(models: Sequence[ModelInfo], *, single: bool = False) -> bytes:
    """``GET /v1/models`` (or ``/v1/models/{model}`` with ``single``: one model given)."""
    if single:
        return orjson.dumps(model_entry(models[0]))
    return orjson.dumps({"object": "list", "data": [model_entry(m) for m in models]})


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated completion request."""

    kind: Kind
    generate: Generate
    stream: bool
    #: ``stream_options.include_usage``: a last chunk with the usage, before ``[DONE]``.
    include_usage: bool
    #: The ``model`` asked for (the server resolves it: docs/openai-api.md).
    model: str | None = None

    @property
    def n(self) -> int:
        """How many choices it asks for."""
        return self.generate.n


#: OpenAI fields that would change the answer and that nothing here
#: implements, with the value that asks for nothing (``None``: none does).
#: Refused by name, never ignored; fields that change nothing (``user``,
#: ``store``, ``metadata``, ``service_tier``, …) are ignored.
_UNSUPPORTED: Final[dict[str, Any]] = {
    "echo": False,
    "suffix": None,
    "best_of": 1,
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "reasoning_effort": None,
    "verbosity": None,
    "functions": None,
    "function_call": None,
}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, "bad_request", param)


def parse_request(kind: Kind, body: bytes, request_id: str, limits: Limits) -> ApiRequest:
    """Validate a completion body; raise :class:`ApiError` with OpenAI's shape."""
    obj = parse_json(body)
    given = {key: value for key, value in obj.items() if value is not None}
    n = given.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise _bad(f"'n' must be an integer from 1 to {MAX_CHOICES}", "n")
    for name, neutral in _UNSUPPORTED.items():
        if name in given and given[name] != neutral:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"'{name}' is not supported by this server (it would change the answer)",
                "unsupported_option",
                name,
            )
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    include_usage = False
    options = given.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        include_usage = options.get("include_usage") is True
    model = given.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    frame: dict[str, Any] = {"type": "generate", "id": request_id}
    images = _Images(ImageBudget(lambda message: ProtocolError("bad_request", message)))
    if kind == "chat":
        if "messages" not in given:
            raise _bad("'messages' is required", "messages")
        frame["messages"] = _messages(given["messages"], images)
    else:
        if "prompt" not in given:
            raise _bad("'prompt' is required", "prompt")
        frame["prompt"] = _prompt(given["prompt"])
    # max_completion_tokens is the newer name; OpenAI takes either.
    for name in ("max_completion_tokens", "max_tokens"):
        if name in given:
            frame["max_tokens"] = given[name]
            break
    for name in ("temperature", "top_p", "top_k", "seed", "stop", *SAMPLING_FIELDS):
        if name in given:
            frame[name] = given[name]
    if "tools" in given:
        frame["tools"] = given["tools"]
    frame.update(_tool_choice(given))
    frame.update(_logprobs(kind, given))
    # llama-server's extensions (and Ollama's keep_alive), then OpenAI's way to ask for JSON.
    for name in (
        "grammar",
        "json_schema",
        "chat_template_kwargs",
        "reasoning_format",
        "keep_alive",
        "reasoning_budget_tokens",
        "speculative",
    ):
        if name in given:
            frame[name] = given[name]
    if "thinking_budget_tokens" in given and "reasoning_budget_tokens" not in given:
        # llama-server reads either name (reasoning_budget_tokens first).
        frame["reasoning_budget_tokens"] = given["thinking_budget_tokens"]
    if "response_format" in given:
        schema = _response_format(given["response_format"])
        if schema is not None:
            if "grammar" in frame or "json_schema" in frame:
                raise _bad(
                    "give one of 'response_format', 'json_schema' and 'grammar'", "response_format"
                )
            frame["json_schema"] = schema
    try:
        generate = parse_client_frame(orjson.dumps(frame).decode(), limits)
        assert isinstance(generate, Generate)
        if images.by_message and generate.messages is not None:
            messages = with_images(generate.messages, images.by_message, images.budget.fail)
            generate = dataclasses.replace(generate, messages=messages)
    except ProtocolError as exc:
        raise ApiError.from_protocol(exc) from None
    if n > 1:
        generate = dataclasses.replace(generate, n=n, choice_of=generate.id)
    return ApiRequest(kind, generate, stream, include_usage, model)


def _tool_choice(given: dict[str, Any]) -> dict[str, Any]:
    """``tool_choice`` and ``parallel_tool_calls`` for the frame, whose parser
    checks them. Without ``tools`` the harmless values are dropped (clients
    send ``"none"`` or ``"auto"`` by habit); others are refused there."""
    out: dict[str, Any] = {
        n: given[n] for n in ("tool_choice", "parallel_tool_calls") if n in given
    }
    if "tools" not in given:
        if out.get("tool_choice") in ("auto", "none"):
            del out["tool_choice"]
        if isinstance(out.get("parallel_tool_calls"), bool):
            del out["parallel_tool_calls"]
    return out


def _logprobs(kind: Kind, given: dict[str, Any]) -> dict[str, Any]:
    """The frame's ``logprobs``/``top_logprobs``: chat takes them as they are
    (the frame's parser checks them); completions' legacy ``logprobs`` is the
    number of alternatives (0-20)."""
    if kind == "chat":
        return {name: given[name] for name in ("logprobs", "top_logprobs") if name in given}
    if "logprobs" not in given:
        return {}
    count = given["logprobs"]
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TOP_LOGPROBS:
        raise _bad(
            f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per token)",
            "logprobs",
        )
    return {"logprobs": True, "top_logprobs": count}


def _response_format(value: Any) -> Any:
    """The JSON Schema ``response_format`` asks for (None: plain text).

    ``json_object`` is any JSON object; ``json_schema`` takes
    ``json_schema.schema`` (``strict`` changes nothing: the grammar is always
    strict). As llama-server, ``json_object`` may carry a ``schema`` too.
    """
    if not isinstance(value, dict):
        raise _bad("'response_format' must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return value.get("schema", {"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("'response_format.json_schema' must be an object", "response_format")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _bad("'response_format.json_schema.schema' must be an object", "response_format")
        return schema
    raise _bad(
        "'response_format.type' must be one of text, json_object, json_schema", "response_format"
    )


def _prompt(value: Any) -> Any:
    # One prompt only: a list of one string is what many clients send.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, list):
        raise _bad(
            "only one prompt per request is supported (no batch; several choices: n)", "prompt"
        )
    return value


@dataclass
class _Images:
    """A request's images as its messages are read: checked, by message index."""

    budget: ImageBudget
    #: An ``http(s)`` URL is an :class:`ImageUrl`: fetched before the request runs.
    by_message: dict[int, list[bytes | ImageUrl]] = field(default_factory=dict)

    def part(self, part: dict[str, Any], index: int) -> str:
        """An ``image_url`` part: its image kept, its marker for the text."""
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        where = f"messages[{index}].content"
        try:
            data = self.budget.url_or_data(url, where)
        except ProtocolError as exc:
            raise _bad(exc.message, "messages") from None
        self.by_message.setdefault(index, []).append(data)
        return IMAGE_MARKER

    def audio(self, part: dict[str, Any], index: int) -> str:
        """An ``input_audio`` part (``{"data": base64, "format": "wav"|"mp3"}``,
        also ``"flac"``): its sound kept at its place, as an image is."""
        spec = part.get("input_audio")
        where = f"messages[{index}].content"
        at = f"audio {self.budget.sounds} ({where})"
        if not isinstance(spec, dict) or set(spec) - {"data", "format"}:
            raise _bad(f"{at}: input_audio must be {{'data': base64, 'format': 'wav'}}", "messages")
        given = spec.get("format")
        if given not in AUDIO_FORMATS:
            raise _bad(f"{at}: input_audio.format must be one of wav, mp3, flac", "messages")
        try:
            data = self.budget.audio_from_base64(spec.get("data"), where)
        except ProtocolError as exc:
            raise _bad(exc.message, "messages") from None
        found = audio_format(data)
        if found != given:
            raise _bad(f"{at}: input_audio.format is {given}, its bytes are {found}", "messages")
        self.by_message.setdefault(index, []).append(data)
        return IMAGE_MARKER


def _messages(value: Any, images: _Images) -> Any:
    if not isinstance(value, list):
        return value  # the protocol's parser says what is wrong
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise _bad(f"messages[{index}] must be an object", "messages")
        role = message.get("role")
        mapped = _ROLES.get(role) if isinstance(role, str) else None
        if mapped is None:
            raise _bad(
                f"messages[{index}].role must be one of system, developer, user, assistant, tool",
                "messages",
            )
        entry: dict[str, Any] = {"role": mapped}
        # An assistant's tool calls, a tool result's call id, a name: as given
        # (null is "not given"), for the protocol's parser to check.
        for name in ("tool_calls", "tool_call_id", "name"):
            if message.get(name) is not None:
                entry[name] = message[name]
        # An assistant's reasoning, by llama-server's (and DeepSeek's) name, or
        # by vLLM's and OpenRouter's (``reasoning``); both given must agree.
        given = {
            k: message[k] for k in ("reasoning_content", "reasoning") if message.get(k) is not None
        }
        for key, reasoning in given.items():
            if mapped != "assistant":
                raise _bad(
                    f"messages[{index}].{key}: only an assistant message carries reasoning",
                    "messages",
                )
            if not isinstance(reasoning, str):
                raise _bad(f"messages[{index}].{key} must be a string", "messages")
        if len(set(given.values())) > 1:
            raise _bad(
                f"messages[{index}]: reasoning_content and reasoning differ (give one)", "messages"
            )
        if given:
            entry["reasoning"] = next(iter(given.values()))
        content = message.get("content")
        if content is not None or "tool_calls" not in entry:
            entry["content"] = _content(content, index, images)
        out.append(entry)
    return out


def _content(value: Any, index: int, images: _Images) -> Any:
    """A message's text: a string, or the text parts of a list joined (an
    image part, its image kept aside, as the marker of its place)."""
    if value is None:
        return ""  # an assistant message may have no content
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if isinstance(part, dict) and part.get("type") == "image_url":
            texts.append(images.part(part, index))
            continue
        if isinstance(part, dict) and part.get("type") == "input_audio":
            texts.append(images.audio(part, index))
            continue
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _bad(
                f"messages[{index}].content: only text, image_url and input_audio parts "
                "are supported",
                "messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"messages[{index}].content: a text part needs a string 'text'", "messages")
        texts.append(text)
    return "".join(texts)

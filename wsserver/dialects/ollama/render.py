"""One Ollama answer, rendered (sans-I/O): newline-delimited JSON objects, or one object.

A :class:`OllamaAnswer` is the dialect's
:class:`~wsserver.dialects.exchange.Renderer` on the HTTP exchange. Streamed
(``stream`` true, Ollama's default) the answer is ``application/x-ndjson``,
one JSON object per line::

    {"model", "created_at", "message": {"role": "assistant", "content", "thinking"?,
     "tool_calls"?}, "logprobs"?, "done": false}          (/api/chat; /api/generate
                                                          has "response", "thinking"?)
    ...
    {... "done": true, "done_reason", "total_duration", "load_duration",
     "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"}

Whole (``stream`` false) it is the last object alone, with everything
gathered: the message's whole ``content``, ``thinking`` and ``tool_calls``
(``/api/generate``: ``response``, ``thinking``).

**Text and thinking** come as the request driver paces them (one object per
``delta``: the reasoning as ``thinking``, the answer as ``content``).
**Tool calls** go out whole, as Ollama sends them: a call's parts are kept
until it is complete — the next call begins, or the answer ends — and then
it is one object's ``tool_calls`` entry, ``{"id", "function": {"index",
"name", "arguments": {…}}}``, its arguments parsed (``{}`` for a call that
``num_predict`` cut short: ``done_reason`` ``length`` says so). A finished
request with calls is ``done_reason`` ``stop``, as Ollama's.

**The durations** are nanoseconds, from the driver's measured timings
(:class:`~wsserver.core.protocol.Timings`, from the request's receipt):
``total_duration`` its whole time; ``load_duration`` the time until the
engine was the request's (a model's load, and a wait for a free slot);
``prompt_eval_duration`` from then to the first output (the prompt read,
the first token made); ``eval_duration`` from the first output to the end.
``prompt_eval_count`` is the prompt's tokens (those reused from the prefix
cache included: Ollama's clients add it to ``eval_count`` for the context
used), ``eval_count`` the tokens generated (thinking included).

**Errors** are ``{"error": "…"}``: the whole answer with its status, or —
once a stream began — its last line, which Ollama's clients raise on.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

import orjson

from ...core.call_parts import CallPart
from ...core.protocol import Delta, Done, Timings, Usage
from ..exchange import Failure, Renderer
from .api import Kind, error_object, refusal_wording

__all__ = ["MEDIA_TYPE", "OllamaAnswer", "created_at", "durations", "loaded_object"]

#: A streamed answer's content type, as Ollama's.
MEDIA_TYPE: Final = "application/x-ndjson"

Clock = Callable[[], str]


def created_at() -> str:
    """Now, as Ollama writes ``created_at`` (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(ms: float) -> int:
    return max(0, round(ms * 1_000_000))


def durations(timings: Timings, usage: Usage) -> dict[str, int]:
    """The last object's counts and durations (see the module docstring)."""
    first = timings.ttft_ms if timings.ttft_ms is not None else timings.total_ms
    return {
        "total_duration": _ns(timings.total_ms),
        "load_duration": _ns(timings.queued_ms),
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": _ns(first - timings.queued_ms),
        "eval_count": usage.completion_tokens,
        "eval_duration": _ns(timings.total_ms - first),
    }


def loaded_object(kind: Kind, model: str, reason: str, clock: Clock = created_at) -> bytes:
    """The answer to a request with nothing to answer: the model ``load``-ed
    or ``unload``-ed (one object, streamed or not)."""
    obj: dict[str, Any] = {"model": model, "created_at": clock()}
    if kind == "chat":
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    obj.update(done=True, done_reason=reason)
    return orjson.dumps(obj)


def _line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj) + b"\n"


def _arguments(text: str) -> Any:
    try:
        value = orjson.loads(text) if text else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class _Call:
    __slots__ = ("id", "index", "name", "parts")

    def __init__(self, part: CallPart) -> None:
        self.index = part.index
        self.id = part.id
        self.name = part.name or ""
        self.parts: list[str] = []

    def whole(self) -> dict[str, Any]:
        function = {"index": self.index, "name": self.name}
        function["arguments"] = _arguments("".join(self.parts))
        return {"id": self.id, "function": function} if self.id else {"function": function}


class OllamaAnswer(Renderer):
    """One ``/api/chat`` or ``/api/generate`` answer (see the module docstring)."""

    media_type = MEDIA_TYPE
    #: Ollama's streams have no keep-alive line; nothing is sent while a request waits.
    keepalive = b""

    def __init__(
        self, kind: Kind, model: str, *, stream: bool, logprobs: bool, clock: Clock = created_at
    ) -> None:
        self.kind: Kind = kind
        #: The name the client asked for (Ollama echoes it).
        self.model = model
        self.stream = stream
        self._logprobs = logprobs
        self._clock = clock
        #: Calls begun, by index; those not sent yet.
        self._calls: dict[int, _Call] = {}
        self._pending: list[_Call] = []
        #: A whole answer's text, reasoning and log-probabilities.
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tokens: list[dict[str, Any]] = []

    def refusal_wording(self, message: str) -> str:
        return refusal_wording(message)

    # ------------------------------------------------------------ objects

    def _object(
        self,
        text: str,
        reasoning: str | None,
        calls: list[_Call],
        logprobs: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": self.model, "created_at": self._clock()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["thinking"] = reasoning
            if calls:
                message["tool_calls"] = [call.whole() for call in calls]
            obj["message"] = message
        else:
            obj["response"] = text
            if reasoning:
                obj["thinking"] = reasoning
        if logprobs is not None:
            obj["logprobs"] = logprobs
        return obj

    def _take_calls(self, parts: tuple[CallPart, ...] | None) -> list[_Call]:
        """Add a delta's call parts; return the calls now complete (a later one began)."""
        complete: list[_Call] = []
        for part in parts or ():
            call = self._calls.get(part.index)
            if call is None:
                complete.extend(self._pending)
                call = self._calls[part.index] = _Call(part)
                self._pending = [call]
            call.parts.append(part.arguments)
        return complete

    def _final(self, done: Done) -> dict[str, Any]:
        reason = "length" if done.reason == "length" else "stop"
        return {"done": True, "done_reason": reason, **durations(done.timings, done.usage)}

    # ------------------------------------------------------------ streamed

    def chunk(self, delta: Delta) -> bytes:
        complete = self._take_calls(delta.tool_calls)
        logprobs = self._wire_logprobs(delta)
        if not (delta.text or delta.reasoning or complete or logprobs):
            return b""  # only the arguments of a call still open
        obj = self._object(delta.text, delta.reasoning, complete, logprobs)
        obj["done"] = False
        return _line(obj)

    def last(self, done: Done) -> bytes:
        out = b""
        if self._pending:
            obj = self._object("", None, self._pending, None)
            obj["done"] = False
            out = _line(obj)
            self._pending = []
        return out + _line({**self._object("", None, [], None), **self._final(done)})

    def error_event(self, failure: Failure) -> bytes:
        return _line(error_object(failure.message))

    # ------------------------------------------------------------ whole

    def gather(self, delta: Delta) -> None:
        self._take_calls(delta.tool_calls)
        if delta.text:
            self._text.append(delta.text)
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        self._tokens.extend(self._wire_logprobs(delta) or ())

    def body(self, done: Done) -> bytes:
        calls = list(self._calls.values())
        logprobs = self._tokens if self._logprobs else None
        obj = self._object("".join(self._text), "".join(self._reasoning), calls, logprobs)
        return orjson.dumps({**obj, **self._final(done)})

    def error_body(self, failure: Failure) -> tuple[int, bytes]:
        return failure.status, orjson.dumps(error_object(failure.message))

    def _wire_logprobs(self, delta: Delta) -> list[dict[str, Any]] | None:
        if not self._logprobs or not delta.logprobs:
            return None
        return [token.to_wire() for token in delta.logprobs]

"""The OpenAI HTTP API's answers, without the I/O (sans-I/O).

``delta`` and ``done`` frames in, OpenAI's JSON objects and Server-Sent Events
out: :class:`Reply` writes the chunks and bodies of one completion (chat or
legacy), :class:`CompletionAnswer` is the dialect's
:class:`~wsserver.dialects.exchange.Renderer` for the HTTP exchange — streamed, one
``data:`` chunk per ``delta``, then the finish chunk, the usage chunk if asked
for and ``[DONE]``; whole, the text gathered (with its reasoning,
log-probabilities and tool calls) into one ``chat.completion`` or
``text_completion`` body. A failure is OpenAI's error object: the whole
answer with its status, or — once a stream began and cannot change its
status — an in-band event the ``openai`` SDKs raise ``APIError`` on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

import orjson

from ...core.call_parts import CallPart
from ...core.logprobs import TokenLogprob, legacy_logprobs
from ...core.protocol import Delta, Done
from ...sse import DONE
from ..api_errors import error_body, error_object
from ..exchange import Failure, Renderer
from .api import ApiRequest, Kind
from .tools import chunk_tool_calls, message_tool_calls

__all__ = ["DONE_EVENT", "CompletionAnswer", "Reply", "error_event"]

DONE_EVENT: Final = b"data: " + DONE.encode() + b"\n\n"


def error_event(status: int, message: str, code: str) -> bytes:
    """The error object as an SSE event: a stream that already began cannot
    change its status, so a failure after the headers is reported in-band
    (the ``openai`` SDKs raise ``APIError`` on it)."""
    obj = {"error": error_object(status, message, code, None)}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Reply:
    """The chunks and bodies of one completion: the same ``id``, ``created``
    and ``model`` on every one, in the shape of its kind."""

    __slots__ = ("_chunk_object", "_first", "_head", "_offset", "include_usage", "kind", "logprobs")

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        created: int,
        *,
        include_usage: bool,
        logprobs: bool = False,
    ) -> None:
        self.kind = kind
        self.include_usage = include_usage
        #: The request asked for log-probabilities: every choice carries its tokens'.
        self.logprobs = logprobs
        #: Completions' ``text_offset``: the length of the tokens' text so far.
        self._offset = 0
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self._head = {"id": prefix + request_id, "created": created, "model": model}
        self._chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._first = True

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        obj: dict[str, Any] = {**self._head, "object": self._chunk_object, "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None  # as OpenAI: null on every chunk but the usage one
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def text_chunk(
        self,
        text: str,
        reasoning: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        tool_calls: Sequence[CallPart] | None = None,
    ) -> bytes:
        """One SSE event with this text (the first one also names the role);
        reasoning goes first, as ``reasoning_content`` (llama-server's name),
        tool call parts last (wsserver.dialects.openai.tools); and, if asked for, its
        tokens' log-probabilities."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if self._first:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or not (reasoning or tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = chunk_tool_calls(tool_calls)
            self._first = False
            return self._chunk(
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": self._logprobs(logprobs or ()),
                    "finish_reason": None,
                }
            )
        return self._chunk(
            {
                "index": 0,
                "text": text,
                "logprobs": self._logprobs(logprobs or ()),
                "finish_reason": None,
            }
        )

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """A choice's ``logprobs``: OpenAI's chat object, or the legacy one."""
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [entry.to_wire() for entry in entries], "refusal": None}
        legacy = legacy_logprobs(entries, self._offset)
        self._offset += sum(len(entry.token) for entry in entries)
        return legacy

    def final_chunks(self, done: Done) -> bytes:
        """The finish chunk, the usage chunk if asked for, and ``[DONE]``."""
        reason = _finish_reason(done)
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None}
        choice["finish_reason"] = reason
        out = self._chunk(choice)
        if self.include_usage:
            obj = {
                **self._head,
                "object": self._chunk_object,
                "choices": [],
                "usage": _usage(done),
            }
            out += b"data: " + orjson.dumps(obj) + b"\n\n"
        return out + DONE_EVENT

    def body(
        self,
        text: str,
        done: Done,
        reasoning: str = "",
        logprobs: Sequence[TokenLogprob] | None = None,
        tool_calls: Sequence[CallPart] = (),
    ) -> bytes:
        """The whole answer of a request without ``stream``."""
        reason = _finish_reason(done)
        if self.kind == "chat":
            content = text if text or not tool_calls else None
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = message_tool_calls(tool_calls)
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": self._logprobs(logprobs or ()),
                "finish_reason": reason,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._logprobs(logprobs or ()),
                "finish_reason": reason,
            }
            kind = "text_completion"
        return orjson.dumps(
            {**self._head, "object": kind, "choices": [choice], "usage": _usage(done)}
        )


def _finish_reason(done: Done) -> str:
    return done.reason if done.reason in ("length", "tool_calls") else "stop"


def _usage(done: Done) -> dict[str, Any]:
    prompt, completion = done.usage.prompt_tokens, done.usage.completion_tokens
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # What the engine's prefix cache saved (as OpenAI's prompt caching reports it).
        "prompt_tokens_details": {"cached_tokens": done.usage.cached_tokens},
    }
    if done.usage.reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": done.usage.reasoning_tokens}
    return usage


class CompletionAnswer(Renderer):
    """One completion's answer on the HTTP exchange: SSE chunks, or the whole body."""

    def __init__(self, request: ApiRequest, model: str, *, created: int | None = None) -> None:
        self.stream = request.stream
        generate = request.generate
        self.reply = Reply(
            request.kind,
            generate.id,
            model,
            int(time.time()) if created is None else created,
            include_usage=request.include_usage,
            logprobs=bool(generate.logprobs),
        )
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._tool_calls: list[CallPart] = []

    def chunk(self, delta: Delta) -> bytes:
        return self.reply.text_chunk(delta.text, delta.reasoning, delta.logprobs, delta.tool_calls)

    def last(self, done: Done) -> bytes:
        return self.reply.final_chunks(done)

    def error_event(self, failure: Failure) -> bytes:
        return error_event(failure.status, failure.message, failure.code)

    def gather(self, delta: Delta) -> None:
        self._text.append(delta.text)
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        if delta.logprobs:
            self._logprobs.extend(delta.logprobs)
        if delta.tool_calls:
            self._tool_calls.extend(delta.tool_calls)

    def body(self, done: Done) -> bytes:
        text, reasoning = "".join(self._text), "".join(self._reasoning)
        return self.reply.body(text, done, reasoning, self._logprobs, self._tool_calls)

    def error_body(self, failure: Failure) -> tuple[int, bytes]:
        return failure.status, error_body(failure.status, failure.message, failure.code)

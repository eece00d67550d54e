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

    __slots__ = (
        "_chunk_object",
        "_head",
        "_offsets",
        "_started",
        "include_usage",
        "kind",
        "logprobs",
    )

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
        #: Completions' ``text_offset`` of each choice: its tokens' text so far.
        self._offsets: dict[int, int] = {}
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self._head = {"id": prefix + request_id, "created": created, "model": model}
        self._chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        #: The choices whose first chunk went out (it names the role).
        self._started: set[int] = set()

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
        index: int = 0,
    ) -> bytes:
        """One SSE event with this text of choice ``index`` (the choice's first
        one also names the role); reasoning goes first, as ``reasoning_content``
        (llama-server's name), tool call parts last (wsserver.dialects.openai.tools);
        and, if asked for, its tokens' log-probabilities."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if index not in self._started:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or not (reasoning or tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = chunk_tool_calls(tool_calls)
            self._started.add(index)
            return self._chunk(
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self._logprobs(logprobs or (), index),
                    "finish_reason": None,
                }
            )
        return self._chunk(
            {
                "index": index,
                "text": text,
                "logprobs": self._logprobs(logprobs or (), index),
                "finish_reason": None,
            }
        )

    def _logprobs(self, entries: Sequence[TokenLogprob], index: int = 0) -> dict[str, Any] | None:
        """A choice's ``logprobs``: OpenAI's chat object, or the legacy one."""
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": [entry.to_wire() for entry in entries], "refusal": None}
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(entry.token) for entry in entries)
        return legacy_logprobs(entries, offset)

    def finish_chunk(self, done: Done, index: int = 0) -> bytes:
        """The chunk that ends choice ``index``, with its ``finish_reason``."""
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": index, "delta": {}, "logprobs": None}
        else:
            choice = {"index": index, "text": "", "logprobs": None}
        choice["finish_reason"] = _finish_reason(done)
        return self._chunk(choice)

    def final_chunks(self, done: Done, *, finish: bool = True) -> bytes:
        """The finish chunk (``finish``: not sent yet, choice by choice), the
        usage chunk if asked for, and ``[DONE]``."""
        out = self.finish_chunk(done) if finish else b""
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
        return self.body_of([self.choice(text, done, reasoning, logprobs, tool_calls)], done)

    def body_of(self, choices: list[dict[str, Any]], done: Done) -> bytes:
        """The whole answer with these ``choices`` (:meth:`choice`), ``done``'s usage."""
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        return orjson.dumps(
            {**self._head, "object": kind, "choices": choices, "usage": _usage(done)}
        )

    def choice(
        self,
        text: str,
        done: Done,
        reasoning: str = "",
        logprobs: Sequence[TokenLogprob] | None = None,
        tool_calls: Sequence[CallPart] = (),
        index: int = 0,
    ) -> dict[str, Any]:
        """One choice of a whole answer."""
        reason = _finish_reason(done)
        if self.kind == "chat":
            content = text if text or not tool_calls else None
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = message_tool_calls(tool_calls)
            return {
                "index": index,
                "message": message,
                "logprobs": self._logprobs(logprobs or (), index),
                "finish_reason": reason,
            }
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(logprobs or (), index),
            "finish_reason": reason,
        }


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
        #: How many choices (``n``); each one's text gathered, and how it ended.
        self.n = request.n
        self._gathered = [_Gathered() for _ in range(request.n)]
        self._ends: dict[int, Done] = {}

    def chunk(self, delta: Delta) -> bytes:
        return self.reply.text_chunk(
            delta.text, delta.reasoning, delta.logprobs, delta.tool_calls, delta.choice or 0
        )

    def choice_done(self, done: Done, index: int) -> bytes:
        """Choice ``index`` of several ended (``done``): its finish chunk when
        streamed; kept for the whole body otherwise."""
        self._ends[index] = done
        return self.reply.finish_chunk(done, index) if self.stream else b""

    def last(self, done: Done) -> bytes:
        return self.reply.final_chunks(done, finish=self.n == 1)

    def error_event(self, failure: Failure) -> bytes:
        return error_event(failure.status, failure.message, failure.code)

    def gather(self, delta: Delta) -> None:
        self._gathered[delta.choice or 0].add(delta)

    def body(self, done: Done) -> bytes:
        """The whole answer; with several choices, ``done`` carries their
        summed usage and each choice its own end (:meth:`choice_done`)."""
        choices = [
            self.reply.choice(
                "".join(g.text),
                self._ends.get(index, done),
                "".join(g.reasoning),
                g.logprobs,
                g.tool_calls,
                index,
            )
            for index, g in enumerate(self._gathered)
        ]
        return self.reply.body_of(choices, done)

    def error_body(self, failure: Failure) -> tuple[int, bytes]:
        return failure.status, error_body(failure.status, failure.message, failure.code)


class _Gathered:
    """One choice's parts, gathered for the whole body."""

    __slots__ = ("logprobs", "reasoning", "text", "tool_calls")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tool_calls: list[CallPart] = []

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.tool_calls:
            self.tool_calls.extend(delta.tool_calls)

"""OpenAI's shapes of a model's tool calls (sans-I/O).

A call reaches a chat completion stream as ``delta.tool_calls[i]`` parts: the
first with ``index``, ``id``, ``type`` and ``function.name`` (and the first
``function.arguments`` text), later ones with more ``function.arguments``
under the same ``index`` — the shape the official SDK's streaming helper
accumulates. A non-streamed answer carries the whole calls in
``message.tool_calls``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ...core.call_parts import CallPart

__all__ = ["chunk_tool_calls", "message_tool_calls"]


def chunk_tool_calls(parts: Sequence[CallPart]) -> list[dict[str, Any]]:
    """A chunk's ``delta.tool_calls``."""
    out: list[dict[str, Any]] = []
    for part in parts:
        if part.name is not None:
            out.append(
                {
                    "index": part.index,
                    "id": part.id,
                    "type": "function",
                    "function": {"name": part.name, "arguments": part.arguments},
                }
            )
        else:
            out.append({"index": part.index, "function": {"arguments": part.arguments}})
    return out


def message_tool_calls(parts: Iterable[CallPart]) -> list[dict[str, Any]]:
    """A message's ``tool_calls``: the parts of each call joined."""
    calls: dict[int, dict[str, Any]] = {}
    for part in parts:
        call = calls.get(part.index)
        if call is None:
            calls[part.index] = {
                "id": part.id,
                "type": "function",
                "function": {"name": part.name, "arguments": part.arguments},
            }
        else:
            call["function"]["arguments"] += part.arguments
    return [calls[index] for index in sorted(calls)]

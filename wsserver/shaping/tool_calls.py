"""A model's tool calls, parsed out of its output: one strategy per syntax (sans-I/O).

Models call tools by writing a call in their template's syntax. Which syntax
is read from the chat template's text, the way llama.cpp's ``common/chat.cpp``
tells formats apart (:func:`detect_syntax`); an engine says which one its
output uses (:class:`~wsserver.shaping.shaper.OutputFormat`), and :func:`parser_for`
makes that syntax's parser for one request:

* ``hermes`` (:class:`HermesCalls`) — Hermes 2 Pro, Qwen 2.5/3:
  ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, one block per
  call, after any text;
* ``llama3`` (:class:`Llama3Calls`) — Llama 3.1-3.3: the whole output is
  one JSON call ``{"name": …, "parameters": {…}}`` (or ``arguments``),
  maybe after ``<|python_tag|>``; several may follow, separated by ``;``;
* ``mistral`` (:class:`MistralCalls`) —
  ``[TOOL_CALLS][{"name": …, "arguments": {…}, "id": …}, …]`` after any
  text;
* ``generic`` (:class:`GenericCalls`) — templates that know no tools
  (llama.cpp's generic format): the whole output is JSON,
  ``{"tool_call": {…}}``, ``{"tool_calls": […]}``, ``{"response": "…"}`` or
  a bare call object;
* ``any`` (:class:`AnyCalls`) — all of the above (an engine without a
  template: the fake);
* ``relay`` (:class:`~wsserver.shaping.tool_relay.RelayedCalls`) — calls the
  engine parsed itself (an upstream server's ``tool_calls``), handed over
  as parts beside the text, which is content as it came.

The first five are written in the text: a :class:`~wsserver.shaping.text_calls.TextCalls`
each, which differ only in the markers that open a call and whether a bare
JSON call may open the output; the states they go through, and how a call's
JSON streams and is checked, are :mod:`wsserver.shaping.text_calls`'. Every parser
has the same four members — ``feed(text)`` and ``part(call part)`` give a
:class:`ToolSplit` (content, call parts, a refusal), ``flush(cut=…)`` judges
what was held back at the end, ``calls_made`` counts the calls released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Final, Literal

from ..core.call_parts import (
    FRAGMENT_CHARS,
    CallPart,
    ToolSplit,
    new_call_id,
    new_mistral_call_id,
)
from .call_stream import CallKind
from .text_calls import HERMES_END, TextCalls
from .tool_relay import RelayedCalls

__all__ = [
    "FRAGMENT_CHARS",
    "MARKERS",
    "SYNTAXES",
    "AnyCalls",
    "CallParser",
    "CallPart",
    "GenericCalls",
    "HermesCalls",
    "Llama3Calls",
    "MistralCalls",
    "Syntax",
    "ToolSplit",
    "detect_syntax",
    "new_call_id",
    "parser_for",
]

Syntax = Literal["hermes", "llama3", "mistral", "generic", "any", "relay"]
SYNTAXES: Final = ("hermes", "llama3", "mistral", "generic", "any", "relay")

_HERMES: Final = "<tool_call>"
_MISTRAL: Final = "[TOOL_CALLS]"
_PYTHON_TAG: Final = "<|python_tag|>"
#: The markers the parser reads in a model's text: an engine must render them
#: as text even where its vocabulary makes them control tokens.
MARKERS: Final = (_HERMES, HERMES_END, _MISTRAL, _PYTHON_TAG)


def detect_syntax(template: str | None) -> Syntax:
    """The call syntax a chat template's text teaches its model."""
    if template is None:
        return "any"
    if _HERMES in template:
        return "hermes"
    if _MISTRAL in template:
        return "mistral"
    if _PYTHON_TAG in template or ("<|start_header_id|>" in template and "ipython" in template):
        return "llama3"
    return "generic"


class HermesCalls(TextCalls):
    """``<tool_call>`` opens a call object, after any text."""

    __slots__ = ()
    OPENERS: ClassVar[dict[str, CallKind]] = {_HERMES: "hermes"}


class Llama3Calls(TextCalls):
    """A JSON call opens the output, maybe after ``<|python_tag|>``."""

    __slots__ = ()
    OPENERS: ClassVar[dict[str, CallKind]] = {_PYTHON_TAG: "json"}
    JSON_AT_START: ClassVar[bool] = True


class MistralCalls(TextCalls):
    """``[TOOL_CALLS]`` opens an array of calls, after any text. A fresh id is
    in Mistral's shape: its templates refuse any other when the call comes
    back in the history (:func:`~wsserver.core.call_parts.new_mistral_call_id`)."""

    __slots__ = ()
    OPENERS: ClassVar[dict[str, CallKind]] = {_MISTRAL: "mistral"}
    NEW_ID: ClassVar[Callable[[], str]] = staticmethod(new_mistral_call_id)


class GenericCalls(TextCalls):
    """The whole output is JSON: a call, the envelope, or the answer."""

    __slots__ = ()
    JSON_AT_START: ClassVar[bool] = True


class AnyCalls(TextCalls):
    """Every marker, and a JSON start: for a model whose syntax is not known."""

    __slots__ = ()
    OPENERS: ClassVar[dict[str, CallKind]] = {
        **HermesCalls.OPENERS,
        **MistralCalls.OPENERS,
        **Llama3Calls.OPENERS,
    }
    JSON_AT_START: ClassVar[bool] = True


CallParser = TextCalls | RelayedCalls

_PARSERS: Final[dict[str, type[TextCalls] | type[RelayedCalls]]] = {
    "hermes": HermesCalls,
    "llama3": Llama3Calls,
    "mistral": MistralCalls,
    "generic": GenericCalls,
    "any": AnyCalls,
    "relay": RelayedCalls,
}


def parser_for(
    syntax: Syntax,
    *,
    names: frozenset[str] | None = None,
    parallel: bool = True,
    new_id: Callable[[], str] | None = None,
) -> CallParser:
    """The parser of ``syntax`` for one output: ``names``, the request's
    tools (None: any); ``parallel`` False: at most one call; ``new_id``: a
    fresh id for a call without one (default: the syntax's shape)."""
    parser = _PARSERS.get(syntax)
    if parser is None:
        raise ValueError(f"unknown tool call syntax {syntax!r}")
    return parser(names=names, parallel=parallel, new_id=new_id)

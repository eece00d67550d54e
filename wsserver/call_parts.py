"""A model's tool calls as the core streams them: parts (sans-I/O).

A call goes out in parts: its first has the call's ``index`` (0, 1, … in
the order the model made them), its ``id`` and its function's ``name``, and
the first of its ``arguments`` text; later parts of the same ``index`` carry
more ``arguments``, at most :data:`FRAGMENT_CHARS` each. Every dialect
renders these (OpenAI's ``delta.tool_calls``, the Responses API's
``function_call`` items, Anthropic's ``tool_use`` blocks, the WebSocket
``delta``'s ``tool_calls``); :mod:`wsserver.tool_calls` makes them from a
model's text and :mod:`wsserver.tool_relay` from an upstream's parts.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Final

__all__ = [
    "FRAGMENT_CHARS",
    "CallPart",
    "call_parts",
    "new_call_id",
    "new_mistral_call_id",
    "unknown_tool",
]

#: The most argument text one :class:`CallPart` carries.
FRAGMENT_CHARS: Final = 4096

_ALPHABET: Final = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh call id, in OpenAI's shape (``call_`` and 24 letters/digits)."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


def new_mistral_call_id() -> str:
    """A fresh call id in Mistral's shape: 9 letters/digits. Mistral's chat
    templates refuse any other id when the call comes back in the history
    (``raise_exception("Tool call IDs should be alphanumeric strings with
    length 9!")``), and a streamed call cannot wait for the id the model
    writes after its arguments."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(9))


@dataclass(frozen=True, slots=True)
class CallPart:
    """A piece of call ``index``: its first part has ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def call_parts(
    index: int, arguments: str, call_id: str | None = None, name: str | None = None
) -> list[CallPart]:
    """Call ``index``'s parts for ``arguments``: the first with ``call_id``
    and ``name`` if given (a call's first part), the text in fragments."""
    parts = [CallPart(index, arguments[:FRAGMENT_CHARS], call_id, name)]
    for start in range(FRAGMENT_CHARS, len(arguments), FRAGMENT_CHARS):
        parts.append(CallPart(index, arguments[start : start + FRAGMENT_CHARS]))
    return parts


def unknown_tool(name: str, names: frozenset[str] | None) -> str | None:
    """Why a call of ``name`` is refused (not one of ``names``), or None."""
    if names is not None and name not in names:
        return f"the model called {name[:64]!r}, which is not one of the request's tools"
    return None

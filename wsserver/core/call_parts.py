"""A model's tool calls as the core streams them: parts (sans-I/O).

A call goes out in parts: its first has the call's ``index`` (0, 1, … in
the order the model made them), its ``id`` and its function's ``name``, and
the first of its ``arguments`` text; later parts of the same ``index`` carry
more ``arguments``, at most :data:`FRAGMENT_CHARS` each. Every dialect
renders these (OpenAI's ``delta.tool_calls``, the Responses API's
``function_call`` items, Anthropic's ``tool_use`` blocks, the WebSocket
``delta``'s ``tool_calls``); :mod:`wsserver.shaping.tool_calls` makes them from a
model's text and :mod:`wsserver.shaping.tool_relay` from an upstream's parts.

What every syntax's parser shares is here too: :class:`ToolSplit`, what a
piece of text (or an upstream's part) became, and :class:`CallLedger`, one
output's calls as the request allows them — its tools, how many calls, the
shape of a fresh id — with the first refusal.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "FRAGMENT_CHARS",
    "CallLedger",
    "CallPart",
    "ToolSplit",
    "add_arguments",
    "call_parts",
    "excerpt",
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


def add_arguments(index: int, text: str, calls: list[CallPart]) -> None:
    """More arguments of call ``index``: joined to its last part if that is
    the last of ``calls`` (up to :data:`FRAGMENT_CHARS`), else new parts."""
    while text:
        last = calls[-1] if calls else None
        if last is not None and last.index == index and len(last.arguments) < FRAGMENT_CHARS:
            room = FRAGMENT_CHARS - len(last.arguments)
            calls[-1] = dataclasses.replace(last, arguments=last.arguments + text[:room])
        else:
            room = FRAGMENT_CHARS
            calls.append(CallPart(index, text[:room]))
        text = text[room:]


@dataclass(frozen=True, slots=True)
class ToolSplit:
    """What a piece of text became: content, then call parts (either may be empty)."""

    content: str = ""
    calls: tuple[CallPart, ...] = ()
    #: Why the model's call is refused (then nothing more is parsed).
    error: str | None = None


class CallLedger:
    """One output's calls as its request allows them, and the first refusal.

    ``names``: the request's tools (None: any name); ``parallel`` False: one
    call at most, and what comes after it is not read; ``new_id``: a fresh
    id for a call that brings none. :attr:`made` counts the calls released;
    :attr:`failed` says a call was refused (the parser then reads nothing
    more), and :meth:`take_error` hands the refusal out once.
    """

    __slots__ = ("_error", "failed", "made", "max_calls", "names", "new_id")

    def __init__(
        self, *, names: frozenset[str] | None, parallel: bool, new_id: Callable[[], str]
    ) -> None:
        self.names = names
        self.max_calls = None if parallel else 1
        self.new_id = new_id
        self.made = 0
        self.failed = False
        self._error: str | None = None

    @property
    def full(self) -> bool:
        """No more calls are allowed (one was asked for and made)."""
        return self.max_calls is not None and self.made >= self.max_calls

    def fail(self, message: str) -> None:
        """Refuse the output's call: nothing more is read."""
        self._error = message
        self.failed = True

    def take_error(self) -> str | None:
        """The refusal not handed out yet, if any."""
        error, self._error = self._error, None
        return error

    def known(self, name: str) -> bool:
        """Whether ``name`` is one of the request's tools (failing if not)."""
        refused = unknown_tool(name, self.names)
        if refused is not None:
            self.fail(refused)
        return refused is None

    def check(self, item: Any) -> tuple[str, str, str | None] | None:
        """A whole call's name, arguments (JSON text) and id (if it has one);
        None after failing: a call must name a known function, and its
        arguments (or ``parameters``; maybe a JSON string holding them) must
        be a JSON object."""
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            self.fail(f"the model's tool call names no function: {excerpt(str(item))}")
            return None
        name: str = item["name"]
        if not self.known(name):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                self.fail(f"the arguments of the model's call to {name!r} are not valid JSON")
                return None
        if not isinstance(arguments, dict):
            self.fail(f"the arguments of the model's call to {name!r} are not a JSON object")
            return None
        given = item.get("id")
        call_id = given if isinstance(given, str) and given else None
        return name, orjson.dumps(arguments).decode(), call_id

    def emit(self, name: str, arguments: str, call_id: str | None, calls: list[CallPart]) -> None:
        """Release a whole call: its first part, then its arguments in fragments."""
        calls.extend(call_parts(self.made, arguments, call_id or self.new_id(), name))
        self.made += 1


_SPACES: Final = re.compile(r"\s+")


def excerpt(text: str) -> str:
    """``text`` as an error message quotes it: spaces folded, 80 characters at most."""
    text = _SPACES.sub(" ", text).strip()
    return repr(text[:80] + ("…" if len(text) > 80 else ""))

"""A model's chat template, rendered in a sandbox (the llama engine's prompts).

A GGUF carries its chat template (``tokenizer.chat_template``) as Jinja
source: code that came with a downloaded file. It is rendered here in
Jinja's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` — the
environment llama-cpp-python's own ``Jinja2ChatFormatter`` uses, with the
same options (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the
``{% generation %}`` tag passed through, Transformers' ``tojson``) so that a
prompt is the one the model's authors meant — and stricter in three ways:

* an attribute the sandbox deems unsafe (``__class__``, ``__globals__``,
  ``mro``, a mutating method) **raises** at once rather than rendering as an
  empty undefined value, so an escape attempt is an error, not silence;
* ``*`` and ``**`` are bounded, so a template cannot build a gigabyte string
  in one operation;
* every failure — a syntax error, ``raise_exception(…)`` (how templates refuse
  a conversation they do not support), a sandbox violation, a type error — is
  a :class:`~wsserver.errors.BackendError` with the wire code ``bad_request``
  and a short message; the template's traceback stays in the server.

A sandbox stops escapes, not bombs: a loop, a doubling macro or one native
string operation still takes a core or a gigabyte. So the server never uses
this class itself — :mod:`.llama_template_worker` processes do, each bounded
in time and memory (:mod:`.llama_template_pool`); a :class:`MemoryError` is
therefore left to the caller, never turned into a refusal here.

Inputs are OpenAI's shapes (``messages`` with ``tool_calls``; ``tools``) plus
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``strftime_now`` and
the request's ``chat_template_kwargs``. A tool call's ``arguments`` reach the
template as an object when they are JSON text of one: templates write them
with ``| tojson`` (Hermes, Qwen, Llama 3.x, Mistral), as Transformers expects.
A ``developer`` message is rendered as ``system``: templates know no other.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.protocol import Message
from ..errors import BackendError

__all__ = ["MAX_RENDERED_CHARS", "ChatTemplate", "TemplateLoadError", "template_messages"]

#: The longest string a template may build with ``*`` (and the longest prompt).
MAX_RENDERED_CHARS: Final = 4 << 20


class TemplateLoadError(Exception):
    """The template's source does not compile."""


class _GenerationTag(jinja2.ext.Extension):
    """Transformers' ``{% generation %}…{% endgeneration %}``: the body, as is."""

    tags = {"generation"}  # noqa: RUF012 - as jinja2.ext.Extension declares it

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} is not allowed in a chat template")

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "**":
            if isinstance(right, int | float) and abs(right) > 64:
                raise SecurityError("exponent too large in a chat template")
            return operator.pow(left, right)
        if isinstance(left, int) and isinstance(right, str | list | tuple):
            left, right = right, left
        sequence = isinstance(left, str | list | tuple) and isinstance(right, int)
        if sequence and len(left) * right > MAX_RENDERED_CHARS:
            raise SecurityError("a chat template built too long a sequence")
        return operator.mul(left, right)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Transformers' tojson: not HTML-escaped, non-ASCII kept (Jinja's own escapes both).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise _TemplateRefused(str(message))


#: The tool and call :meth:`ChatTemplate._needs_string_content` renders.
_PROBE_TOOL: Final = {
    "name": "probe",
    "description": "A probe.",
    "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
}
_PROBE_CALL: Final = {"name": "probe", "arguments": {"a": "b"}}


class _TemplateRefused(Exception):
    """``raise_exception(…)`` in a template."""


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """``messages`` as a template reads them (see the module docstring)."""
    out = []
    for message in messages:
        entry = message.to_openai()
        if message.role == "developer":
            entry["role"] = "system"
        for call in entry.get("tool_calls", ()):
            function = call["function"]
            try:
                parsed = json.loads(function["arguments"])
            except ValueError:
                continue
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        out.append(entry)
    return out


class ChatTemplate:
    """One compiled chat template. Thread-safe: rendering keeps no state."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        environment = _Sandbox(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        environment.filters["tojson"] = _tojson
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateLoadError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        #: The template cannot take an assistant message of calls alone with
        #: ``content: null`` (Qwen 3's tests ``in content``): it gets ``""``.
        self.string_content = False
        self.string_content = self._needs_string_content()

    def _needs_string_content(self) -> bool:
        """Whether a tool-call turn renders only with ``""`` as its content (as
        llama.cpp's template capabilities probe it: render both, compare)."""
        call = {"id": "call_1", "type": "function", "function": _PROBE_CALL}
        turns: list[dict[str, Any]] = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ]

        def renders(content: Any) -> bool:
            turns[1]["content"] = content
            try:
                self._template.render(
                    messages=turns,
                    tools=[{"type": "function", "function": _PROBE_TOOL}],
                    add_generation_prompt=True,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    raise_exception=_raise_exception,
                    strftime_now=_strftime_now,
                )
            except MemoryError:
                raise  # a bomb, not a shape it cannot take: the load fails
            except Exception:  # whatever a template raises: it cannot take it
                return False
            return True

        return not renders(None) and renders("")

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt; :class:`BackendError` (``bad_request``) if the template fails."""
        return self.render_entries(
            template_messages(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            extra=extra,
        )

    def render_entries(
        self,
        entries: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """:meth:`render` of messages already as a template reads them
        (:func:`template_messages`; a template worker's input). A
        :class:`MemoryError` is not caught: it is the caller's bound."""
        variables: dict[str, Any] = dict(extra or {})
        if self.string_content:
            for entry in entries:
                if entry.get("content") is None:
                    entry["content"] = ""
        variables.update(
            messages=entries,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )
        try:
            prompt = self._template.render(**variables)
        except _TemplateRefused as exc:
            raise _refused(f"the model's chat template refused the request: {exc}") from None
        except SecurityError as exc:
            raise _refused(f"the chat template did something not allowed: {exc}") from None
        except RecursionError:
            raise _refused("the chat template recursed too deeply") from None
        except MemoryError:
            raise
        except Exception as exc:  # jinja2 errors, and whatever a template's types raise
            detail = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise _refused(f"the chat template failed: {detail}") from None
        if len(prompt) > MAX_RENDERED_CHARS:
            raise _refused("the chat template rendered too long a prompt")
        return prompt


def _refused(message: str) -> BackendError:
    return BackendError(message[:400], code="bad_request")

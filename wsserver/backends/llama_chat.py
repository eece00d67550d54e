"""The llama backend's chat: messages → prompt text, the tools, what the output looks like.

:class:`LlamaChat` holds a model's chat template — compiled and rendered by
bounded worker processes (:class:`~.llama_template_pool.BoundedTemplate`),
or none, for a model without one (the default Gemma 3 270M base model):
then the plain-text fallback :func:`plain_chat_prompt` — and makes of a
chat request what the engine needs: the prompt's text and extra stop
strings; the request's tools, shown by the template or, when it cannot
show them, by the server in llama.cpp's generic JSON format
(:func:`generic_tools_note`), a grammar then holding the answer to it
(:meth:`LlamaChat.forced_call`, as for a forced call); and what its output
will look like (:meth:`LlamaChat.output_format`: whether the template
opened a think block, and the call syntax the template teaches,
:func:`~wsserver.shaping.tool_calls.detect_syntax`). :meth:`LlamaChat.check`
renders a request before it starts, so that the template's refusal comes
first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ..core.protocol import Generate, Message
from ..errors import BackendError, ModelLoadError, WireCode
from ..shaping.reasoning import opens_reasoning
from ..shaping.shaper import OutputFormat
from ..shaping.tool_calls import Syntax, detect_syntax
from .llama_template import ChatTemplate, TemplateLoadError
from .llama_template_pool import BoundedTemplate, TemplateBounds, TemplatePool
from .llama_tool_grammar import forced_call_grammar
from .request import GenerationRequest

if TYPE_CHECKING:
    from .llama_vocab import Vocabulary

__all__ = [
    "CHAT_FALLBACK_STOPS",
    "LlamaChat",
    "PreparedPrompt",
    "generic_tools_note",
    "plain_chat_prompt",
]

log = logging.getLogger("wsserver.llama")

_ROLE_LABELS = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}

#: Stop strings added to every chat request rendered by the plain-text
#: fallback: generation ends at the next role prefix, so that a base model
#: does not go on to write the other side's turn.
CHAT_FALLBACK_STOPS = ("\nUser:", "\nSystem:", "\nAssistant:", "\nTool:")


def plain_chat_prompt(messages: Sequence[Message]) -> str:
    """The chat fallback for models without a chat template.

    One line per message, ``System: …``, ``User: …``, ``Assistant: …``,
    ``Tool: …`` (``developer`` is ``System``; an assistant's tool calls follow
    its text as JSON), then ``Assistant:`` for the model to continue.
    Generation also stops at :data:`CHAT_FALLBACK_STOPS`.
    """
    lines = []
    for m in messages:
        text = m.content
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]
            text = " ".join(filter(None, (text, orjson.dumps(calls).decode())))
        lines.append(f"{_ROLE_LABELS[m.role]}: {text}")
    lines.append("Assistant:")
    return "\n".join(lines)


def generic_tools_note(tools: str, *, parallel: bool | None, required: bool = True) -> str:
    """The system text that shows a model whose chat template knows no tools
    (or that has none) the request's tools and the generic call format — the
    format a grammar then holds its answer to."""
    functions = [tool["function"] for tool in orjson.loads(tools)]
    if parallel is not True:
        shape = '{"tool_call": {"name": "<function name>", "arguments": {<its arguments>}}}'
    else:
        shape = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}, …]}'
    note = (
        "You can call these functions (each with the JSON Schema of its arguments):\n"
        + orjson.dumps(functions).decode()
        + "\nTo call them, answer with JSON only, in this form: "
        + shape
    )
    if not required:
        note += '\nTo answer without calling one: {"response": "<your answer>"}'
    return note


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A chat request's prompt, worked out by the backend's ``prepare`` on a
    worker thread — what the loop-side question (``output_format``) and the
    engine's admission read instead of rendering the chat template
    themselves (:attr:`GenerationRequest.prepared`)."""

    tokens: tuple[int, ...] = ()
    stops: tuple[str, ...] = ()
    opens_reasoning: bool = False
    #: The server, not the template, shows the tools (:meth:`LlamaChat.describes_tools`).
    describes_tools: bool = False
    #: Why there is no prompt (wire code, message): the template refused the
    #: messages or exceeded a bound. The engine ends the request with it.
    error: tuple[WireCode, str] | None = None
    #: The prompt's images (:class:`.llama_vision.ImageSpan`), at negative tokens.
    media: tuple[Any, ...] = ()


class LlamaChat:
    """A model's chat template (or the fallback), and what it makes of requests."""

    __slots__ = ("template",)

    def __init__(self) -> None:
        #: The model's chat template: rendered by worker processes (a
        #: :class:`ChatTemplate` in-process is accepted too: tests); None: the fallback.
        self.template: BoundedTemplate | ChatTemplate | None = None

    def load(self, model: Any, *, file: str, bounds: TemplateBounds) -> TemplatePool | None:
        """Load the chat template — ``file``'s, else the model's own — into
        worker processes within ``bounds`` (this process never runs the
        file's Jinja itself): the pool that renders it, or None for a model
        without one (the fallback). A template that cannot be read, compiled
        or probed is :class:`~wsserver.errors.ModelLoadError`."""
        template, origin = _template_source(file, model)
        if not template:
            log.info("chat: the model has no chat template; using the plain-text fallback")
            return None
        bos, eos = model.token_bos(), model.token_eos()
        pool = TemplatePool(bounds)
        try:
            self.template = pool.load(
                template,
                eos_token=model.token_get_text(eos) if eos != -1 else "",
                bos_token=model.token_get_text(bos) if bos != -1 else "",
            )
        except (TemplateLoadError, BackendError) as exc:
            pool.close()
            hint = "" if file else " (set backend.llama.chat_template_file)"
            if isinstance(exc, BackendError) and exc.code != "bad_request":
                hint = ""  # no worker started: not the template's fault
            raise ModelLoadError(f"{origin}: {exc}{hint}") from None
        log.info("chat: using %s", origin)
        return pool

    def render(
        self, messages: Sequence[Message], tools: str | None, template_kwargs: str | None
    ) -> str:
        """The prompt the chat template makes of a request; ``bad_request`` if it fails."""
        assert self.template is not None
        return self.template.render(
            messages,
            tools=orjson.loads(tools) if tools is not None else None,
            extra=orjson.loads(template_kwargs) if template_kwargs is not None else None,
        )

    def prompt(self, request: GenerationRequest) -> tuple[str, tuple[str, ...], bool]:
        """A chat request's prompt text, the stop strings it adds, and whether
        it is the fallback's (which the BOS token opens; a template writes
        its own)."""
        messages, tools = self.chat_input(request)
        template = self.template
        if template is None:
            return plain_chat_prompt(messages), CHAT_FALLBACK_STOPS, True
        rendered = self.render(messages, tools, request.chat_template_kwargs)
        eos = template.eos_token
        return rendered, (eos,) if eos else (), False

    def tokens(
        self, request: GenerationRequest, vocab: Vocabulary
    ) -> tuple[list[int], tuple[str, ...]]:
        """The prompt's tokens and the stop strings, as llama-cpp-python would
        make them (or as the backend's ``prepare`` made them). ``bad_request``
        for a prompt of no tokens: the input's fault (an empty prompt, or a
        chat template that rendered nothing), not the engine's."""
        prepared = request.prepared
        if isinstance(prepared, PreparedPrompt):
            if prepared.error is not None:
                code, message = prepared.error
                raise BackendError(message, code=code)
            return list(prepared.tokens), prepared.stops
        stops = tuple(request.stop)
        if request.prompt is not None:
            tokens = vocab.bos + vocab.tokenize(request.prompt, add_bos=False)
            if not tokens:
                raise BackendError("the prompt is empty", code="bad_request")
            return tokens, stops
        text, more_stops, fallback = self.prompt(request)
        if fallback:
            return vocab.bos + vocab.tokenize(text, add_bos=False), stops + more_stops
        # The template writes the BOS token itself (as llama-cpp-python's chat handlers assume).
        tokens = vocab.tokenize(text, add_bos=False)
        if not tokens:
            raise BackendError(
                "the model's chat template rendered an empty prompt for these messages",
                code="bad_request",
            )
        return tokens, stops + more_stops

    def describes_tools(self, request: GenerationRequest) -> bool:
        """Whether the server, not the chat template, shows ``request``'s tools
        to the model: when the template cannot (it has none, or renders the
        same with and without them). The answer is then held to the generic
        JSON format (a call, or with ``auto`` also ``{"response": …}``), as
        llama.cpp does for such templates."""
        if request.tools is None or request.messages is None:
            return False
        if isinstance(request.prepared, PreparedPrompt):
            return request.prepared.describes_tools
        if self.template is None:
            return True
        messages, kwargs = request.messages, request.chat_template_kwargs
        try:
            return self.render(messages, request.tools, kwargs) == self.render(
                messages, None, kwargs
            )
        except BackendError:
            return False  # the engine reports the template's refusal

    def chat_input(self, request: GenerationRequest) -> tuple[Sequence[Message], str | None]:
        """The messages and tools the chat template (or the fallback) renders."""
        messages = request.messages or ()
        if not self.describes_tools(request):
            return messages, request.tools
        note = generic_tools_note(
            request.tools or "[]",
            parallel=request.parallel_tool_calls,
            required=request.tool_choice == "required",
        )
        if messages and messages[0].role in ("system", "developer"):
            first = messages[0]
            joined = f"{first.content}\n\n{note}" if first.content else note
            return (dataclasses.replace(first, content=joined), *messages[1:]), None
        return (Message("system", note), *messages), None

    def forced_call(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with the grammar of its tool calls, if it needs one: a
        forced call, or tools the server describes (the generic format)."""
        if request.tools is None:
            return request
        required = request.tool_choice == "required"
        if not required and not self.describes_tools(request):
            return request
        syntax = self.tool_syntax(request)
        grammar = forced_call_grammar(
            "generic" if syntax == "any" else syntax,
            request.tools,
            name=request.tool_name,
            # One call unless several are asked for, as llama-server defaults:
            # a grammar that admits more lets a small model call on and on.
            parallel=request.parallel_tool_calls is True,
            optional=not required,
        )
        return dataclasses.replace(request, grammar=grammar)

    def output_format(self, request: GenerationRequest) -> OutputFormat:
        """Whether the chat template opened a think block (read by the
        backend's ``prepare``), and the call syntax its template teaches."""
        return OutputFormat(self.opens_reasoning(request), self.tool_syntax(request))

    def opens_reasoning(self, request: GenerationRequest) -> bool:
        """Whether ``request``'s prompt ends inside an open think block."""
        if isinstance(request.prepared, PreparedPrompt):
            return request.prepared.opens_reasoning
        if self.template is None or request.messages is None:
            return False
        try:
            messages, tools = self.chat_input(request)
            prompt = self.render(messages, tools, request.chat_template_kwargs)
        except BackendError:
            return False  # the engine reports it
        return opens_reasoning(prompt)

    def tool_syntax(self, request: GenerationRequest) -> Syntax:
        """Read from the chat template, as llama.cpp tells formats apart; the
        generic JSON format where the tools are described by the server (a
        forced call on a model whose template shows no tools, or has none)."""
        if request.tools is not None and self.describes_tools(request):
            return "generic"
        return detect_syntax(self.template.source if self.template else None)

    def check(self, frame: Generate) -> None:
        """Render the chat template now, so that its refusal comes before the start."""
        chat_fields = [
            n for n in ("tools", "chat_template_kwargs") if getattr(frame, n) is not None
        ]
        if frame.messages is None:
            if chat_fields:
                raise BackendError(f"'{chat_fields[0]}' needs 'messages'", code="bad_request")
            return
        if "tools" in chat_fields:
            # "none": the model is not shown them; else the server describes
            # them when the template cannot (generic format).
            chat_fields.remove("tools")
        if self.template is None:
            if chat_fields:
                raise BackendError(
                    f"'{chat_fields[0]}' needs a chat template, and the model has none "
                    "(set backend.llama.chat_template_file)",
                    code="unsupported_option",
                )
            return
        rendered = self.render(frame.messages, frame.tools, frame.chat_template_kwargs)
        constrained = (
            frame.grammar is not None
            or frame.json_schema is not None
            or frame.tool_choice == "required"
            or (
                frame.tools is not None
                and frame.tool_choice != "none"
                and rendered == self.render(frame.messages, None, frame.chat_template_kwargs)
            )
        )
        if opens_reasoning(rendered) and constrained:
            # The grammar would constrain the reasoning too: refused, not misapplied.
            raise BackendError(
                "a grammar, JSON schema or tool call grammar after a think block that the chat "
                "template opens is not supported yet (give chat_template_kwargs that turn "
                "thinking off)",
                code="unsupported_option",
            )

    def forced_grammar(self, frame: Generate) -> GenerationRequest | None:
        """The request a frame's tool calls hold to a grammar of their own (a
        forced call, or tools the server describes), with that grammar, for
        the check to compile; None when its calls are free. A frame that
        also gives a grammar or a schema is refused (``unsupported_option``)."""
        if frame.tools is None or frame.messages is None or frame.tool_choice == "none":
            return None
        request = GenerationRequest.from_frame(frame, default_max_tokens=1)
        if frame.tool_choice != "required" and not self.describes_tools(request):
            return None
        for name in ("grammar", "json_schema"):
            if getattr(frame, name) is not None:
                raise BackendError(
                    f"'{name}' and 'tools' together: the tool calls are held to a grammar "
                    "of their own here (a forced call, or a chat template without tools); "
                    "give one of them",
                    code="unsupported_option",
                )
        return self.forced_call(request)


def _template_source(chat_template_file: str, model: Any) -> tuple[str, str]:
    """The chat template's Jinja source ("" for none) and where it came from."""
    if chat_template_file:
        path = Path(chat_template_file)
        try:
            return path.read_text(encoding="utf-8"), f"the chat template in {path}"
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read the chat template {path}: {exc}") from None
    source = model.metadata().get("tokenizer.chat_template", "")
    return source, "the model's chat template"

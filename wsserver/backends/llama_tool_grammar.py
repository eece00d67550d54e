"""Forced tool calls: a grammar from the tools' schemas, in the model's call syntax.

``tool_choice: "required"`` (or a named function) is enforced, not hoped
for: the request's output is constrained by a GBNF grammar that admits
exactly a call — a tool's name (the named one, or any of the request's
tools) and arguments that match that tool's ``parameters`` schema — written
in the syntax the core's parser (:func:`~wsserver.shaping.tool_calls.parser_for`) reads
for the model's template (llama.cpp does the same in ``common/chat.cpp``):

* ``generic`` (templates that know no tools, and models without a template):
  ``{"tool_call": {"name": …, "arguments": {…}}}``, or with parallel calls
  ``{"tool_calls": [{…}, …]}`` — and with ``tool_choice: "auto"`` also
  ``{"response": "…"}``, the answer without a call (llama.cpp's generic
  format holds ``auto`` to this grammar too);
* ``hermes``: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``,
  repeated for parallel calls;
* ``llama3``: ``{"name": …, "parameters": {…}}``, ``"; "``-separated;
* ``mistral``: ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``.

The JSON part is one JSON Schema (the calls as an ``anyOf`` of objects whose
``name`` is a ``const``) converted by llama.cpp's own converter
(:func:`.llama_schema.schema_to_gbnf`, which refuses what it would not
enforce); a tool schema with local ``$ref`` (``#/$defs/…``, ``#``) is kept
whole under the combined schema's ``$defs``, its references rewritten to it.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Final

import orjson

from ..errors import BackendError
from ..shaping.tool_calls import Syntax
from .llama_schema import schema_to_gbnf

__all__ = ["forced_call_grammar"]

#: The rule the JSON part is renamed to when the grammar wraps it.
_JSON_RULE: Final = "wsserver-call-json"
_ROOT_LINE = re.compile(r"^root ::=", re.MULTILINE)


@functools.lru_cache(maxsize=64)
def forced_call_grammar(
    syntax: Syntax, tools_json: str, *, name: str | None, parallel: bool, optional: bool = False
) -> str:
    """The GBNF grammar of a forced call (``name``: only that function).

    ``optional`` (``tool_choice: "auto"`` in the generic format, which
    llama.cpp also holds to a grammar): ``{"response": "…"}`` — an answer
    without a call — is admitted too.

    Cached (the arguments are text): the check before a request's start
    converts the schemas, its submission finds the grammar made.

    Raises :class:`~wsserver.errors.BackendError`: ``bad_request`` when a
    tool's ``parameters`` cannot be compiled, ``unsupported_option`` when
    they ask for what the grammar would not enforce (naming ``tools``).
    """
    tools = [t["function"] for t in orjson.loads(tools_json)]
    if name is not None:
        tools = [t for t in tools if t["name"] == name]
    if not tools:
        raise BackendError("'tool_choice' names no function of 'tools'", code="bad_request")
    args_key = "parameters" if syntax == "llama3" else "arguments"
    wrap: tuple[str, str] | None = None
    defs: dict[str, Any] = {}
    calls = _calls(tools, args_key, defs)
    schema: dict[str, Any]
    if syntax == "hermes":
        schema = calls
        one = f'"<tool_call>\\n" {_JSON_RULE} "\\n</tool_call>"'
        wrap = (one, f'{one} ("\\n" {one})*' if parallel else one)
    elif syntax == "llama3":
        schema = calls
        wrap = (_JSON_RULE, f'{_JSON_RULE} ("; " {_JSON_RULE})*' if parallel else _JSON_RULE)
    elif syntax == "mistral":
        schema = {"type": "array", "items": calls, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        wrap = (_JSON_RULE, f'"[TOOL_CALLS]" {_JSON_RULE}')
    elif parallel:
        schema = _object("tool_calls", {"type": "array", "items": calls, "minItems": 1})
    else:
        schema = _object("tool_call", calls)
    if optional and wrap is None:
        schema = {"anyOf": [schema, _object("response", {"type": "string"})]}
    if defs:
        schema = {**schema, "$defs": defs}
    try:
        gbnf = schema_to_gbnf(orjson.dumps(schema).decode())
    except BackendError as exc:
        message = str(exc).replace("'json_schema'", "'tools' (a function's parameters)")
        raise BackendError(message, code=exc.code) from None
    if wrap is None:
        return gbnf
    return _ROOT_LINE.sub(f"{_JSON_RULE} ::=", gbnf, count=1) + f"\nroot ::= {wrap[1]}\n"


def _object(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: value},
        "required": [key],
        "additionalProperties": False,
    }


def _calls(tools: list[dict[str, Any]], args_key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """One call of any of ``tools``. A tool whose schema refers to itself
    (``$ref``) is also kept whole in ``defs`` (the top level's ``$defs``),
    where its references now point."""
    options = []
    for index, tool in enumerate(tools):
        parameters = tool.get("parameters", {"type": "object"})
        if _has_ref(parameters):
            parameters = _rebase(parameters, f"#/$defs/wsserver-tool-{index}")
            defs[f"wsserver-tool-{index}"] = parameters
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, args_key: parameters},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    return {"anyOf": options}


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_ref(v) for v in schema)
    return False


def _rebase(schema: Any, where: str) -> Any:
    """``schema`` with its local references pointing to ``where``."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = where + value[1:]
            else:
                out[key] = _rebase(value, where)
        return out
    if isinstance(schema, list):
        return [_rebase(item, where) for item in schema]
    return schema

"""A JSON Schema as GBNF, for the llama engine's grammars (see :mod:`.llama_grammar`).

llama.cpp's own JSON-schema-to-grammar conversion, as shipped with
llama-cpp-python (``llama_cpp.llama_grammar.SchemaConverter``), with integer
bounds (``minimum``, ``maximum``, the exclusive ones) enforced as llama.cpp's
C++ converter enforces them (:mod:`.int_range`; the Python port reads past
them). What the converter would read past without enforcing is refused by
name (:func:`unenforced`), never answered with output that breaks it; what it
is given is bounded first (:mod:`.grammar_bounds`).
"""

from __future__ import annotations

import json
from typing import Any, Final

from llama_cpp.llama_grammar import RESERVED_NAMES, STRING_FORMAT_RULES, SchemaConverter

from ..errors import BackendError
from .grammar_bounds import check_schema
from .int_range import BOUND_KEYWORDS, bounds, integer_rule

__all__ = ["schema_to_gbnf", "unenforced"]

_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
_HEX = "[0-9a-fA-F]"
_ANY_ESCAPE = f'"u" {_HEX} {_HEX} {_HEX} {_HEX}'
_NO_SURROGATE = f'"u" ([0-9a-cA-Ce-fE-F] {_HEX} {_HEX} {_HEX} | [dD] [0-7] {_HEX} {_HEX})'

#: Validation keywords the converter reads past without enforcing them: a
#: schema that uses one is refused, never answered with output that breaks it.
_UNENFORCED: Final = frozenset(
    {
        "multipleOf",
        "minProperties",
        "maxProperties",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "additionalItems",
    }
)
_FORMATS: Final = frozenset(
    {name.removesuffix("-string") for name in STRING_FORMAT_RULES}
    | {"uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
)
_SUBSCHEMA_MAPS: Final = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS: Final = ("anyOf", "oneOf", "allOf", "prefixItems")


def unenforced(schema: Any, path: str = "") -> list[str]:
    """Where ``schema`` asks for what the grammar conversion would not enforce:
    ``"keyword at path"`` entries (empty: everything it asks for is enforced)."""
    if not isinstance(schema, dict):
        return []
    where = path or "the top level"
    found = [f"'{key}' at {where}" for key in sorted(_UNENFORCED & schema.keys())]
    if BOUND_KEYWORDS & schema.keys() and schema.get("type") != "integer":
        # Bounds are enforced on an integer (int_range.py), not on a number.
        found += [
            f'\'{key}\' at {where} (bounds only on "type": "integer")'
            for key in sorted(BOUND_KEYWORDS & schema.keys())
        ]
    fmt = schema.get("format")
    if fmt is not None and fmt not in _FORMATS:
        found.append(f"'format' {str(fmt)[:40]!r} at {where}")
    if ("minLength" in schema or "maxLength" in schema) and (
        schema.get("type") != "string" or "pattern" in schema or "format" in schema
    ):
        # The converter reads string lengths only on a plain string schema.
        found.append(
            f"'minLength'/'maxLength' beside 'pattern', 'format' or no string type at {where}"
        )
    for key in _SUBSCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                found += unenforced(child, f"{path}.{key}.{name}".lstrip("."))
    for key in _SUBSCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for index, child in enumerate(children):
                found += unenforced(child, f"{path}.{key}[{index}]".lstrip("."))
    for key in ("items", "additionalProperties"):
        child = schema.get(key)
        if isinstance(child, dict):
            found += unenforced(child, f"{path}.{key}".lstrip("."))
        elif isinstance(child, list):
            for index, item in enumerate(child):
                found += unenforced(item, f"{path}.{key}[{index}]".lstrip("."))
    return found


def schema_to_gbnf(schema: str) -> str:
    """A JSON Schema (JSON text) as GBNF; ``bad_request`` if it cannot be
    converted, ``unsupported_option`` if it asks for what the grammar would
    not enforce (:func:`unenforced`)."""
    text = "{}" if schema == "true" else schema
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None  # the converter says what is wrong with it
    # What the converter would build, bounded before it builds it.
    check_schema(parsed)
    missing = unenforced(parsed)
    if missing:
        raise BackendError(
            f"'json_schema' asks for what this engine cannot enforce: {', '.join(missing[:3])}"
            " (leave it out, or serve the model through an upstream that enforces it)",
            code="unsupported_option",
        )
    try:
        gbnf = _convert(text)
    except Exception as exc:  # the converter raises whatever it meets
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise BackendError(
            f"'json_schema' could not be compiled to a grammar: {detail}", code="bad_request"
        ) from None
    # The converter llama-cpp-python ships lets a JSON string hold raw control
    # characters, which no JSON parser accepts (llama.cpp's own excludes
    # them), and a \u escape of a UTF-16 surrogate, which strict parsers
    # (orjson, and so our tool-call checks) refuse when it is unpaired: a
    # character beyond the BMP is written as itself instead.
    return gbnf.replace(_LOOSE_CHAR, _STRICT_CHAR).replace(_ANY_ESCAPE, _NO_SURROGATE)


class _BoundedConverter(SchemaConverter):
    """llama-cpp-python's converter, with integer bounds enforced as llama.cpp's
    own converter enforces them (:mod:`.int_range`)."""

    def visit(self, schema: Any, name: str) -> Any:
        if (
            isinstance(schema, dict)
            and schema.get("type") == "integer"
            and BOUND_KEYWORDS & schema.keys()
            and not _SHADOWING & schema.keys()
        ):
            low, high = bounds(schema)
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            rule = f"({integer_rule(low, high)}) space"
            return self._add_rule(rule_name, rule)  # type: ignore[no-untyped-call]
        return super().visit(schema, name)  # type: ignore[no-untyped-call]


#: Keywords the converter reads before an integer's type (its bounds then
#: change nothing: the value is one of those given, or another schema's).
_SHADOWING: Final = frozenset({"$ref", "oneOf", "anyOf", "const", "enum"})


def _convert(text: str) -> str:
    """``json_schema_to_gbnf``, on the converter that enforces integer bounds."""
    options = {"prop_order": {}, "allow_fetch": False, "dotall": False, "raw_pattern": False}
    converter = _BoundedConverter(**options)  # type: ignore[no-untyped-call]
    schema = converter.resolve_refs(json.loads(text), "stdin")
    converter.visit(schema, "")
    return str(converter.format_grammar())  # type: ignore[no-untyped-call]

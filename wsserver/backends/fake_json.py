"""The fake engine's JSON-shaped mode: a seeded document that validates
against a request's JSON Schema (used by :mod:`.fake`).

It covers what apps and tests ask of structured output — ``type`` (one or a
list), ``properties`` (every one is written), ``items`` with
``minItems``/``maxItems``, ``enum``, ``const``, ``anyOf``/``oneOf`` (the
first), string lengths and number ranges — and refuses the rest
(:class:`Unsupported`: ``$ref``, ``allOf``, ``not``, ``pattern``,
``format``, …), so the fake never answers a schema with something it may not
validate against. The content is words of the fake's vocabulary, drawn from
the request's seeded generator.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Final

__all__ = ["Unsupported", "fake_document"]

#: Keywords that only describe (or whose absence of effect is safe here).
_HARMLESS: Final = frozenset(
    {
        "type",
        "properties",
        "required",
        "items",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "additionalProperties",
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "strict",
    }
)
_MAX_DEPTH: Final = 8


class Unsupported(ValueError):
    """A schema keyword the fake cannot honour."""


def fake_document(schema: Any, rng: random.Random, words: Sequence[str]) -> Any:
    """A value that validates against ``schema``; raises :class:`Unsupported`."""
    return _value(schema, rng, words, 0)


def _value(schema: Any, rng: random.Random, words: Sequence[str], depth: int) -> Any:
    if schema is True or schema == {}:
        schema = {"type": "string"}
    if not isinstance(schema, dict):
        raise Unsupported("a schema must be an object or true")
    if depth > _MAX_DEPTH:
        raise Unsupported(f"nesting deeper than {_MAX_DEPTH}")
    unknown = sorted(set(schema) - _HARMLESS)
    if unknown:
        raise Unsupported(f"the fake engine cannot honour {', '.join(unknown[:3])}")
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise Unsupported("enum must be a non-empty list")
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = schema[key]
            if not isinstance(options, list) or not options:
                raise Unsupported(f"{key} must be a non-empty list")
            return _value(options[0], rng, words, depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return _object(schema, rng, words, depth)
    if kind == "array":
        low = int(schema.get("minItems", 1))
        high = int(schema.get("maxItems", max(low, 3)))
        if high < low:
            raise Unsupported("maxItems is below minItems")
        count = rng.randint(low, max(low, min(high, low + 2)))
        return [_value(schema.get("items", True), rng, words, depth + 1) for _ in range(count)]
    if kind == "string":
        return _string(schema, rng, words)
    if kind in ("integer", "number"):
        low = schema.get("minimum", 0)
        high = schema.get("maximum", max(low, 0) + 100)
        if high < low:
            raise Unsupported("maximum is below minimum")
        if kind == "integer":
            return rng.randint(int(-(-low // 1)), int(high // 1))
        return round(rng.uniform(low, high), 3)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise Unsupported(f"type {kind!r}")


def _object(schema: dict[str, Any], rng: random.Random, words: Sequence[str], depth: int) -> Any:
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise Unsupported("properties must be an object")
    out = {name: _value(sub, rng, words, depth + 1) for name, sub in properties.items()}
    for name in schema.get("required", []):
        if name not in out:
            extra = schema.get("additionalProperties", True)
            out[name] = _value(True if extra is False else extra, rng, words, depth + 1)
    if not properties and schema.get("additionalProperties", True) is not False:
        # Any object: a word or two of the fake's, as keys and values.
        for _ in range(rng.randint(1, 2)):
            out[rng.choice(words)] = rng.choice(words)
    return out


def _string(schema: dict[str, Any], rng: random.Random, words: Sequence[str]) -> str:
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
    while len(text) < low:
        text += " " + rng.choice(words)
    if high is not None:
        if int(high) < low:
            raise Unsupported("maxLength is below minLength")
        text = text[: int(high)]
    return text

"""Grammars and schemas the grammar tests share (no wsserver import: the
fault tests run them against any version of the server)."""

from __future__ import annotations

from typing import Any

#: The grammar of issue 34's fault 5: 40 bytes that jammed the engine for good.
JAM = 'root ::= ((("a"{0,20}){0,20}){0,20})'
#: Fault 0's schema: a grammar nested 100,000 deep, which crashed the process.
DEEP_SCHEMA = {"type": "array", "items": {"type": "integer"}, "maxItems": 100000}


#: A pydantic-like model, as pydantic writes one (the model's own object at
#: the top, nested models under $defs): bounded strings and lists, nested
#: objects, enums, optional fields, a recursive reference.
PYDANTIC_LIKE: dict[str, Any] = {
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 100},
                "city": {"type": "string", "maxLength": 60},
                "country": {"enum": ["FR", "DE", "IT", "ES", "GB", "US", "JP"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
            },
            "required": ["street", "city", "country"],
        },
        "Comment": {
            "type": "object",
            "properties": {
                "text": {"type": "string", "maxLength": 280},
                "replies": {"type": "array", "items": {"$ref": "#/$defs/Comment"}, "maxItems": 5},
            },
            "required": ["text"],
        },
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 100},
        "born": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 50},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 50},
        "address": {"$ref": "#/$defs/Address"},
        "comments": {"type": "array", "items": {"$ref": "#/$defs/Comment"}, "maxItems": 10},
        "bio": {"anyOf": [{"type": "string", "maxLength": 1000}, {"type": "null"}]},
    },
    "required": ["name", "tags"],
}

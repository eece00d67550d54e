"""What clients/js and the JSON Schema copy from :mod:`wsserver.core.protocol` still matches it.

The JS client (``wsserver.js``, its types ``wsserver.d.ts``) and
``docs/protocol.schema.json`` restate the request-id rule, the stop-string
limits, the wire codes, the protocol version, the subprotocol and the names
of the ``hello`` limits. The Python side is the source; these are copies, and
a copy that drifts is a client that refuses what the server accepts (or the
reverse). Plain text checks, no JS runtime needed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from wsserver.core.protocol import (
    ID_PATTERN,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    PROTOCOL_VERSION,
    Limits,
)
from wsserver.errors import WIRE_CODES
from wsserver.security import SUBPROTOCOL

ROOT = Path(__file__).resolve().parent.parent
JS = (ROOT / "clients" / "js" / "wsserver.js").read_text()
DTS = (ROOT / "clients" / "js" / "wsserver.d.ts").read_text()
SCHEMA: dict[str, Any] = json.loads((ROOT / "docs" / "protocol.schema.json").read_text())
DEFS: dict[str, Any] = SCHEMA["$defs"]

# ID_PATTERN is one character class with a length range: take it apart once.
_ID_PARTS = re.fullmatch(r"(\[[^\]]+\])\{1,(\d+)\}", ID_PATTERN)
assert _ID_PARTS is not None, ID_PATTERN
ID_CLASS, ID_MAX = _ID_PARTS.group(1), int(_ID_PARTS.group(2))


def _js_const(name: str) -> str:
    match = re.search(rf"^(?:export )?const {name} = (.+);$", JS, re.M)
    assert match is not None, f"no const {name} in wsserver.js"
    return match.group(1)


def test_the_id_rule_matches_everywhere() -> None:
    assert _js_const("ID_RE") == f"/^{ID_PATTERN}$/"
    assert DEFS["Id"]["pattern"] == f"^{ID_PATTERN}$"
    assert f"1\u2013{ID_MAX} of `{ID_CLASS}`" in DTS  # an en dash, as the .d.ts writes it
    assert f"a request id is 1-{ID_MAX} characters" in JS
    # Generated ids are a prefix plus a counter: the prefix uses the same characters.
    prefix = re.search(r"/\^(\[[^\]]+\])\{1,(\d+)\}\$/\.test\(idPrefix\)", JS)
    assert prefix is not None and prefix.group(1) == ID_CLASS
    assert int(prefix.group(2)) < ID_MAX


def test_stop_string_limits_match_the_schema_and_the_types() -> None:
    one, many = DEFS["GenerateOptions"]["properties"]["stop"]["oneOf"]
    assert one["maxLength"] == many["items"]["maxLength"] == MAX_STOP_CHARS
    assert many["maxItems"] == MAX_STOP_STRINGS
    assert f"A stop string or up to {MAX_STOP_STRINGS} of them." in DTS


def test_wire_codes_match_the_schema_and_the_types() -> None:
    assert set(DEFS["ErrorCode"]["enum"]) == WIRE_CODES
    union = re.search(r"export type ErrorCode =((?:\s*\|\s*\"[a-z_]+\")+);", DTS)
    assert union is not None
    assert set(re.findall(r"\"([a-z_]+)\"", union.group(1))) == WIRE_CODES


def test_version_subprotocol_and_hello_limits_match() -> None:
    assert _js_const("PROTOCOL_VERSION") == str(PROTOCOL_VERSION)
    assert f"export declare const PROTOCOL_VERSION: {PROTOCOL_VERSION};" in DTS
    assert DEFS["Hello"]["properties"]["protocol"]["const"] == PROTOCOL_VERSION
    assert _js_const("SUBPROTOCOL") == json.dumps(SUBPROTOCOL)
    assert f'export declare const SUBPROTOCOL: "{SUBPROTOCOL}";' in DTS
    names = [f.name for f in dataclasses.fields(Limits)]
    assert DEFS["Hello"]["properties"]["limits"]["required"] == names
    interface = re.search(r"export interface Limits \{([^}]*)\}", DTS)
    assert interface is not None
    assert re.findall(r"(\w+): number;", interface.group(1)) == names

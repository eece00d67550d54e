"""Grammar-constrained sampling for the batched engine (see :mod:`.llama_samplers`).

* **Compiling.** A ``json_schema`` becomes GBNF through llama.cpp's own
  JSON-schema-to-grammar conversion, as shipped with llama-cpp-python
  (``llama_cpp.llama_grammar.json_schema_to_gbnf``); GBNF becomes a native
  grammar sampler (``llama_sampler_init_grammar``), which returns NULL for a
  grammar it cannot parse. Either failure is a ``bad_request`` — checked
  before the request starts (:meth:`GrammarCache.compile`), never answered
  with unconstrained text.
* **The cache.** Compiled grammars are kept by their text, bounded by bytes
  (the text and its GBNF), least recently used first out. A request gets a
  clone of the cached prototype (a grammar sampler has the parse state of
  one output).
* **Sampling: the grammar checks the sampled token first** (as llama.cpp's
  common sampler does). The chain runs on the full candidate list; if the
  grammar accepts the token drawn, that is the token. Only when it rejects it
  is the grammar asked about the candidates — and then, unlike llama.cpp's
  common sampler, not about the whole vocabulary but about the few tokens
  that can pass (:meth:`Candidates.constrain`: by the prefixes the grammar
  allows and by rank), with the same result. So a constrained sequence costs
  the batch a grammar check per token and a millisecond or two now and then,
  not a 25-80 ms pass over every token; unconstrained sequences keep the
  native ``llama_sampler_sample`` path and pay nothing.
"""

from __future__ import annotations

import copy
import ctypes
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import STRING_FORMAT_RULES, json_schema_to_gbnf

from ..errors import BackendError
from .grammar_bounds import check_gbnf, check_schema

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "Candidates",
    "GrammarCache",
    "schema_to_gbnf",
    "unenforced",
    "utf8_needed",
]

#: What the compiled-grammar cache may hold, in bytes of grammar text.
DEFAULT_CACHE_BYTES = 4 << 20

_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
_HEX = "[0-9a-fA-F]"
_ANY_ESCAPE = f'"u" {_HEX} {_HEX} {_HEX} {_HEX}'
_NO_SURROGATE = f'"u" ([0-9a-cA-Ce-fE-F] {_HEX} {_HEX} {_HEX} | [dD] [0-7] {_HEX} {_HEX})'
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
#: The prefix table's row and column for "no byte there" (an empty text, a one-byte text).
_NO_BYTE = 256
#: Ask about second bytes only when at most this many ASCII first bytes pass.
_SECOND_BYTE_MAX = 32


#: Validation keywords the converter reads past without enforcing them: a
#: schema that uses one is refused, never answered with output that breaks it.
_UNENFORCED: Final = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
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
        gbnf = str(json_schema_to_gbnf(text))
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


class GrammarCache:
    """Native grammar prototypes by their text, bounded by bytes. Thread-safe."""

    def __init__(self, vocab: Any, *, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._vocab = vocab
        self.max_bytes = max_bytes
        self.bytes = 0
        self._lock = threading.Lock()
        #: (kind, text) → (prototype, its size in bytes)
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self.compiled = 0

    def compile(
        self, *, grammar: str | None, json_schema: str | None, field: str | None = None
    ) -> Any:
        """The prototype for a request's constraint (None: none); raises
        ``bad_request`` (it cannot be parsed) or ``unsupported_option`` (beyond
        a bound of :mod:`.grammar_bounds`, checked before llama.cpp parses it).
        ``field``: the request field the grammar came from, for the message."""
        if grammar is not None:
            key = ("gbnf", grammar)
        elif json_schema is not None:
            key = ("schema", json_schema)
        else:
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry[0]
        gbnf = grammar if grammar is not None else schema_to_gbnf(key[1])
        if field is None:
            field = "grammar" if grammar is not None else "json_schema"
        check_gbnf(
            gbnf, subject=f"'{field}'" if grammar is not None else f"'{field}' (as a grammar)"
        )
        prototype = llama_cpp.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"), b"root")
        if not prototype:
            raise BackendError(
                f"'{field}' could not be parsed as a GBNF grammar with a 'root' rule",
                code="bad_request",
            )
        size = len(key[1]) + (0 if grammar is not None else len(gbnf))
        with self._lock:
            self.compiled += 1
            old = self._entries.pop(key, None)
            if old is not None:  # compiled twice at once: keep one
                self.bytes -= old[1]
                llama_cpp.llama_sampler_free(old[0])
            self._entries[key] = (prototype, size)
            self.bytes += size
            while self.bytes > self.max_bytes and len(self._entries) > 1:
                _, (evicted, evicted_size) = self._entries.popitem(last=False)
                self.bytes -= evicted_size
                llama_cpp.llama_sampler_free(evicted)
        return prototype

    def instance(self, *, grammar: str | None, json_schema: str | None) -> Any:
        """A fresh grammar sampler for one request (None: unconstrained)."""
        if grammar is None and json_schema is None:
            return None
        while True:
            prototype = self.compile(grammar=grammar, json_schema=json_schema)
            with self._lock:
                # Evicted meanwhile by another compile? Then compile it again.
                if any(entry[0] is prototype for entry in self._entries.values()):
                    return llama_cpp.llama_sampler_clone(prototype)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        with self._lock:
            for prototype, _ in self._entries.values():
                llama_cpp.llama_sampler_free(prototype)
            self._entries.clear()
            self.bytes = 0


class Candidates:
    """The candidate lists of a constrained sequence, reused every step.

    ``full`` holds every token (``load``); ``short`` the few the grammar is
    asked about when it rejected the sampled token (:meth:`constrain`).

    Two kinds of token are never candidates of a constrained sequence, so
    that the grammar's view of the output and the text sent stay the same:

    * tokens without text (``piece`` gives no bytes) other than
      end-of-generation — control and unknown tokens, markers like
      ``<start_of_image>`` (:mod:`.token_text`): llama.cpp's grammar matches
      them by their text (``<s>``, ``<unk>``, ``<start_of_turn>``), which the
      engine never emits;
    * a token that would make the bytes invalid UTF-8 (a continuation byte
      where a character should start, anything else where one should go
      on): llama.cpp's grammar decodes such bytes leniently, the engine's
      text drops them, and the two would part.

    **The exact shortcut.** llama.cpp's grammar checks every token it is
    given against its state, decoding the token's text each time: ~100 ns a
    token, 25-80 ms over a 262,144-token vocabulary — one decode step of the
    whole batch, paid by every sequence in it. :meth:`constrain` gives it only
    tokens that can pass, and gets the same answer:

    1. *By prefix.* A token the grammar accepts has every prefix of its text
       accepted too (a prefix of a viable string is viable). The grammar is
       asked about the 256 single-byte tokens (one per byte value), and —
       where few ASCII bytes pass, as between JSON values — about each
       passing byte followed by each byte (on a clone that accepted the
       first). Tokens whose first byte, or first two bytes, failed are out:
       a table lookup per token.
    2. *By rank.* When the chain keeps only the ``top`` most likely tokens
       (``top_k``, or 1 for greedy) and many tokens survive step 1 (inside a
       JSON string nearly all do), the survivors go to the grammar best
       first, 256, then eight times as many, until ``top`` pass: every token
       not asked about is less likely than all of those, so top-k of the
       grammar's full answer is among them.

    The chain then runs on that short list. Its result equals the chain on
    the full list filtered by the grammar (the tokens left out would have
    been ``-inf``), which the tests check token by token.
    """

    #: The prefix test costs 256 probes and more: not worth it on a small vocabulary.
    PREFIX_FROM = 4096
    #: Rank the survivors of the prefix test (best first) only above this
    #: many, asking about ``FIRST_RANK`` of them first.
    RANKED_FROM = 4096
    FIRST_RANK = 256

    def __init__(self, vocab: Any, n_vocab: int, piece: Callable[[int], bytes]) -> None:
        self.n_vocab = n_vocab
        self._ids = np.arange(n_vocab, dtype=np.int32)
        first = np.full(n_vocab, _NO_BYTE, dtype=np.int32)
        second = np.full(n_vocab, _NO_BYTE, dtype=np.int32)
        control = np.zeros(n_vocab, dtype=bool)
        probes = np.full(256, -1, dtype=np.int32)
        for t in range(n_vocab):
            eog = llama_cpp.llama_vocab_is_eog(vocab, t)
            data = piece(t) if not eog else b""
            control[t] = not data and not eog
            if data:
                first[t] = data[0]
                if len(data) > 1:
                    second[t] = data[1]
                elif probes[data[0]] < 0 and not control[t]:
                    probes[data[0]] = t
        continuation = (first >= 0x80) & (first <= 0xBF)
        #: Banned where a character starts, and where one goes on.
        self._banned_at_start = (
            control
            | continuation
            | (first == 0xC0)
            | (first == 0xC1)
            | ((first >= 0xF5) & (first != _NO_BYTE))
        )
        self._banned_inside = ~continuation
        #: Each token's cell in the prefix table (row: first byte, column: second).
        self._cell = first * (_NO_BYTE + 1) + second
        #: A single-byte token per byte value (-1: the vocabulary has none).
        self.probe_tokens = probes
        #: Tokens the grammar was asked about in the last :meth:`constrain` (probes included).
        self.asked = 0
        self._buffers()

    def _buffers(self) -> None:
        """What a sampling writes: its own for each :meth:`fresh` copy."""
        self._probe = _Array(256)
        self.full = _Array(self.n_vocab)
        self.short = _Array(self.n_vocab)
        # One token, for the grammar's check of the sampled one.
        self._one = _Array(1)
        #: The sequence's logits, copied (:meth:`snapshot`) so that grammar
        #: work off the engine thread never reads the context's buffers.
        self.logits = np.zeros(self.n_vocab, dtype=np.float32)

    def fresh(self) -> Candidates:
        """The same tables with buffers of its own: for the next sequences,
        when a grammar call still running uses these (an abandoned one)."""
        other = copy.copy(self)
        other._buffers()
        return other

    def snapshot(self, logits: Any) -> None:
        """Copy a sequence's logits (``llama_get_logits_ith``'s pointer) for :meth:`load`."""
        self.logits[:] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))

    @property
    def pointer(self) -> Any:
        return self.full.pointer

    def _banned(self, inside: bool) -> Any:
        return self._banned_inside if inside else self._banned_at_start

    def load(self, *, inside: bool = False) -> None:
        """Every token with its logit (the :meth:`snapshot`) into :attr:`full`;
        ``inside``: the bytes so far end inside a character."""
        data = self.full.data
        data["id"] = self._ids
        data["logit"] = self.logits
        data["logit"][self._banned(inside)] = -np.inf
        data["p"] = 0.0
        self.full.reset(self.n_vocab)

    def constrain(self, grammar: Any, *, inside: bool, top: int) -> Any:
        """The loaded list as ``grammar`` filters it, for the chain to run on:
        a pointer to :attr:`short`. ``top``: the chain keeps at most that many
        of the most likely tokens (0: it may keep any). See the class docstring."""
        data = self.full.data
        self.asked = 0
        keep = np.isfinite(data["logit"])
        if not inside and self.n_vocab >= self.PREFIX_FROM:
            keep &= self._prefixes(grammar).take(self._cell)
        survivors = np.flatnonzero(keep)
        short = self.short
        if top > 0 and len(survivors) > self.RANKED_FROM:
            logits = data["logit"][survivors]
            size = self.FIRST_RANK
            while size < len(survivors) // 2:
                best = np.argpartition(logits, -size)[-size:]
                self._ask(grammar, data.take(survivors[best]))
                if int(np.isfinite(short.data["logit"][: short.native.size]).sum()) >= top:
                    return short.pointer
                size *= 8
        self._ask(grammar, data.take(survivors))
        return short.pointer

    def _ask(self, grammar: Any, rows: Any) -> None:
        n = len(rows)
        self.short.data[:n] = rows
        self.short.reset(n)
        self.asked += n
        llama_cpp.llama_sampler_apply(grammar, self.short.pointer)

    def _prefixes(self, grammar: Any) -> Any:
        """The prefix table, flattened: may a token with these first two bytes pass?"""
        table = np.ones((_NO_BYTE + 1, _NO_BYTE + 1), dtype=bool)
        passing = self._passing_bytes(grammar)
        table[:256, :] = passing[:, None]
        ascii_passing = [b for b in range(128) if passing[b] and self.probe_tokens[b] >= 0]
        if len(ascii_passing) <= _SECOND_BYTE_MAX:
            for byte in ascii_passing:
                after = llama_cpp.llama_sampler_clone(grammar)
                try:
                    llama_cpp.llama_sampler_accept(after, int(self.probe_tokens[byte]))
                    table[byte, :256] = self._passing_bytes(after)
                finally:
                    llama_cpp.llama_sampler_free(after)
        return table.ravel()

    def _passing_bytes(self, grammar: Any) -> Any:
        """Which byte values the grammar lets a token start with (True where
        the vocabulary has no single-byte token to ask with)."""
        probe = self._probe
        known = self.probe_tokens >= 0
        probe.data["id"] = np.where(known, self.probe_tokens, 0)
        probe.data["logit"] = 0.0
        probe.data["p"] = 0.0
        probe.reset(256)
        self.asked += 256
        llama_cpp.llama_sampler_apply(grammar, probe.pointer)
        return np.isfinite(probe.data["logit"]) | ~known

    def accepts(self, grammar: Any, token: int, *, inside: bool = False) -> bool:
        """Whether ``grammar`` in its current state allows ``token`` next."""
        if self._banned(inside)[token]:
            return False
        one = self._one
        one.data[0] = (token, 1.0, 0.0)
        one.reset(1)
        llama_cpp.llama_sampler_apply(grammar, one.pointer)
        return bool(np.isfinite(one.data["logit"][0]))


class _Array:
    """A ``llama_token_data_array`` over a numpy buffer of ``capacity`` entries."""

    def __init__(self, capacity: int) -> None:
        self.data = np.zeros(capacity, dtype=_TOKEN_DATA)
        self.native = llama_cpp.llama_token_data_array(
            data=self.data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=capacity,
            selected=-1,
            sorted=False,
        )
        self.pointer = ctypes.pointer(self.native)
        self._address = self.native.data

    def reset(self, size: int) -> None:
        # The data pointer too: a stage may have pointed it elsewhere.
        self.native.data = self._address
        self.native.size = size
        self.native.selected = -1
        self.native.sorted = False

    def selected(self) -> int:
        # Through the struct's pointer: a stage may have pointed it elsewhere.
        return int(self.native.data[self.native.selected].id)


def utf8_needed(needed: int, data: bytes) -> int:
    """How many continuation bytes are still due after ``data``, ``needed`` before it."""
    for byte in data:
        if needed > 0 and 0x80 <= byte <= 0xBF:
            needed -= 1
        elif byte >= 0xF0:
            needed = 3
        elif byte >= 0xE0:
            needed = 2
        elif byte >= 0xC0:
            needed = 1
        else:
            needed = 0
    return needed

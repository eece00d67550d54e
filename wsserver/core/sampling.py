"""The sampler chain's options and structured output, on the wire (sans-I/O).

The ``generate`` frame (and the OpenAI API, mapped onto it) takes every
option of llama-server's sampler chain under llama-server's names, with its
defaults; this module validates them (:func:`parse_sampling_fields`) and
resolves what a request asked for into one :class:`Sampling` value that the
engines read. llama-server's default order, which the llama engine builds::

    logit_bias → penalties (repeat, presence, frequency) → DRY → top_k →
    typical_p → top_p → min_p → XTC → temperature → the draw (seeded)

and, beside the chain, a grammar (``grammar``, or one compiled from a
``json_schema``) that the sampled token must satisfy.

Each option has a *neutral* value at which its stage changes nothing
(``repeat_penalty`` 1, ``presence_penalty`` 0, …). An engine that lacks a
stage refuses a request that gives the option a value other than the neutral
one (``unsupported_option``) instead of ignoring it: see
:func:`options_asked`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Final

import orjson

from ..errors import ProtocolError

__all__ = [
    "DEFAULT_DRY_BREAKERS",
    "LOGIT_BIAS_MAX",
    "MAX_CHOICES",
    "MAX_DRY_BREAKERS",
    "MAX_LOGIT_BIAS",
    "MAX_TOP_LOGPROBS",
    "NEUTRAL",
    "SAMPLING_FIELDS",
    "STRUCTURE_FIELDS",
    "LogitBias",
    "Sampling",
    "options_asked",
    "parse_sampling_fields",
]

#: At most this many ``logit_bias`` entries, and biases within ±this.
MAX_LOGIT_BIAS: Final = 1024
LOGIT_BIAS_MAX: Final = 100.0
#: DRY's sequence breakers: at most this many, each 1-64 characters.
MAX_DRY_BREAKERS: Final = 16
MAX_DRY_BREAKER_CHARS: Final = 64
DEFAULT_DRY_BREAKERS: Final = ("\n", ":", '"', "*")
#: The most alternatives ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS: Final = 20
#: The most choices (``n``) one request may ask for (OpenAI's bound); a
#: model's ``parallel`` bounds them too (docs/openai-api.md, "Several choices").
MAX_CHOICES: Final = 128
#: Window sizes (``repeat_last_n``, ``dry_penalty_last_n``) are capped here.
_MAX_WINDOW: Final = 1 << 20

#: A ``logit_bias`` key that is a token id: an ASCII decimal integer, maybe signed.
_TOKEN_ID: Final = re.compile(r"[+-]?[0-9]+", re.ASCII)

#: A logit bias entry: a token id, or a string whose tokens all get the bias
#: (llama-server's extension); ``-inf`` bans the token (``false`` on the wire).
LogitBias = tuple[tuple[int | str, float], ...]


@dataclass(frozen=True, slots=True)
class Sampling:
    """The chain's options beyond temperature/top_p/top_k, resolved (llama-server's defaults)."""

    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    #: Tokens the penalties look back over: -1 = the context size, 0 = none.
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: LogitBias = ()
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    #: Tokens DRY looks back over: -1 = the context size, 0 = none.
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1

    @classmethod
    def from_options(cls, given: dict[str, Any]) -> Sampling:
        """The defaults, with the options that were given (``None``: not given)."""
        return cls(**{k: v for k, v in given.items() if v is not None})

    @property
    def penalties(self) -> bool:
        """Whether the penalties stage changes anything."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def xtc(self) -> bool:
        return self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5


#: The sampler options on the wire, in the chain's order.
SAMPLING_FIELDS: Final = tuple(f.name for f in fields(Sampling))
#: Structured output on the wire.
STRUCTURE_FIELDS: Final = ("grammar", "json_schema")

#: The value at which each option that *is* a stage changes nothing. A stage's
#: parameters (``repeat_last_n``, ``dry_base``, ``xtc_threshold``, …) are not
#: listed: alone they ask for nothing.
NEUTRAL: Final[dict[str, Any]] = {
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": (),
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "grammar": None,
    "json_schema": None,
    # Chat-template inputs (wsserver.core.chat_input): an engine that renders no
    # template and relays none refuses them.
    "tools": None,
    "chat_template_kwargs": None,
    # Not a stage, but an engine must compute it (docs/protocol.md, "Log-probabilities").
    "logprobs": False,
}


def options_asked(frame: Any) -> set[str]:
    """The stage options ``frame`` (a ``Generate``) gives a non-neutral value."""
    asked = set()
    for name, neutral in NEUTRAL.items():
        value = getattr(frame, name)
        if value is not None and value != neutral:
            asked.add(name)
    return asked


Fail = Callable[[str], ProtocolError]


def parse_sampling_fields(obj: dict[str, Any], fail: Fail, max_chars: int) -> dict[str, Any]:
    """Validate the sampler and structured-output fields present in ``obj``."""
    out: dict[str, Any] = {}
    for name, low, high in (
        ("min_p", 0.0, 1.0),
        ("typical_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
        ("dry_multiplier", 0.0, 100.0),
        ("dry_base", 1.0, 100.0),
        ("xtc_probability", 0.0, 1.0),
        ("xtc_threshold", 0.0, 1.0),
    ):
        if name in obj:
            out[name] = _number(obj[name], name, low, high, fail)
    if "repeat_penalty" in obj:
        value = _number(obj["repeat_penalty"], "repeat_penalty", 0.0, 10.0, fail)
        if value <= 0.0:
            raise fail("'repeat_penalty' must be > 0 and <= 10 (1 = off)")
        out["repeat_penalty"] = value
    for name in ("repeat_last_n", "dry_penalty_last_n"):
        if name in obj:
            out[name] = _integer(obj[name], name, -1, _MAX_WINDOW, fail, "(-1 = the context size)")
    if "dry_allowed_length" in obj:
        out["dry_allowed_length"] = _integer(
            obj["dry_allowed_length"], "dry_allowed_length", 0, _MAX_WINDOW, fail, ""
        )
    if "dry_sequence_breakers" in obj:
        out["dry_sequence_breakers"] = _breakers(obj["dry_sequence_breakers"], fail)
    if "logit_bias" in obj:
        out["logit_bias"] = _logit_bias(obj["logit_bias"], fail)
    if "grammar" in obj:
        grammar = obj["grammar"]
        if not isinstance(grammar, str) or not 1 <= len(grammar) <= max_chars:
            raise fail(f"'grammar' must be a GBNF text of 1 to {max_chars} characters")
        out["grammar"] = grammar
    if "json_schema" in obj:
        schema = obj["json_schema"]
        if not isinstance(schema, dict | bool):
            raise fail("'json_schema' must be a JSON Schema (an object, or true)")
        text = orjson.dumps(schema).decode()
        if len(text) > max_chars:
            raise fail(f"'json_schema' exceeds {max_chars} characters")
        out["json_schema"] = text
    if "grammar" in out and "json_schema" in out:
        raise fail("give at most one of 'grammar' and 'json_schema'")
    return out


def _number(value: Any, name: str, low: float, high: float, fail: Fail) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(f"'{name}' must be a number")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise fail(f"'{name}' must be between {low:g} and {high:g}")
    return number


def _integer(value: Any, name: str, low: int, high: int, fail: Fail, note: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        suffix = f" {note}" if note else ""
        raise fail(f"'{name}' must be an integer from {low} to {high}{suffix}")
    return value


def _breakers(value: Any, fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_DRY_BREAKERS:
        raise fail(f"'dry_sequence_breakers' must be a list of at most {MAX_DRY_BREAKERS} strings")
    for item in value:
        if not isinstance(item, str) or not 1 <= len(item) <= MAX_DRY_BREAKER_CHARS:
            raise fail(
                f"each DRY sequence breaker must be a string of 1 to {MAX_DRY_BREAKER_CHARS} "
                "characters"
            )
    return tuple(value)


def _logit_bias(value: Any, fail: Fail) -> LogitBias:
    """``{"15043": 2.5, "Hello": -1}`` or ``[[15043, 2.5], ["Hello", false]]``.

    A key that is a decimal integer, signed or not, is a token id (as
    llama-server reads it; a negative one is refused by name, not taken for
    text); any other string is text, each of whose tokens gets the bias
    (llama-server's extension). ``false`` bans the token(s).
    """
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = []
        for item in value:
            if not isinstance(item, list) or len(item) != 2:
                raise fail("'logit_bias' as a list holds [token or text, bias] pairs")
            pairs.append((item[0], item[1]))
    else:
        raise fail(
            "'logit_bias' must be an object of token id (or text) → bias, or a list of pairs"
        )
    if len(pairs) > MAX_LOGIT_BIAS:
        raise fail(f"'logit_bias' has more than {MAX_LOGIT_BIAS} entries")
    out: list[tuple[int | str, float]] = []
    for key, bias in pairs:
        token: int | str
        if isinstance(key, bool):
            raise fail("a 'logit_bias' key must be a token id or a non-empty text")
        if isinstance(key, int):
            token = key
        elif isinstance(key, str) and key:
            token = key
            if _TOKEN_ID.fullmatch(key):
                # More than ten digits is beyond any id (and int() of a
                # very long one is slow, then refused).
                digits = key.lstrip("+-").lstrip("0")
                token = int(key) if len(digits) <= 10 else 2**31
        else:
            raise fail("a 'logit_bias' key must be a token id or a non-empty text")
        if isinstance(token, int) and not 0 <= token < 2**31:
            raise fail(f"a 'logit_bias' token id must be an integer >= 0, not {str(key)[:40]}")
        if bias is False:
            out.append((token, -math.inf))
            continue
        out.append((token, _number(bias, "logit_bias", -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX, fail)))
    return tuple(out)

"""Ollama's ``options``, ``keep_alive``, ``format`` and ``think``, mapped onto the core (sans-I/O).

**Honour or refuse, never ignore.** Every option Ollama's API documents is
in one of four tables:

* :data:`SAMPLER` — honoured: the core's sampler field of the same meaning
  (``num_predict`` is ``max_tokens``; the rest keep their names);
* :data:`NEUTRAL_ONLY` — a stage the engines here do not have (``mirostat``,
  ``tfs_z``, ``penalize_newline``, …): accepted only at the value that asks
  for nothing, any other refused naming the option;
* :data:`LOAD_OPTIONS` — how Ollama loads a model (``num_gpu``, ``num_thread``,
  ``use_mmap``, …): they do not change the answer, and here the operator's
  configuration decides how a model loads: accepted, not applied;
* ``num_ctx`` — checked by the route against the model's context
  (:func:`check_num_ctx`): above it refused, at or below it a bound on the
  request's output.

Any other option is refused as unknown. Options left out take the server's
defaults (``config/default.toml``), not Ollama's: a model here has no
Modelfile.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final

from ..api_errors import ApiError

__all__ = [
    "LOAD_OPTIONS",
    "NEUTRAL_ONLY",
    "SAMPLER",
    "bad_request",
    "check_num_ctx",
    "parse_format",
    "parse_keep_alive",
    "parse_options",
    "parse_think",
]

#: Ollama's option → the ``generate`` frame's field (honoured).
SAMPLER: Final[dict[str, str]] = {
    "num_predict": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
}

#: Options the engines here have no stage for, with the value that asks for
#: nothing (a check): any other value is refused naming the option.
NEUTRAL_ONLY: Final[dict[str, tuple[Any, str]]] = {
    "mirostat": (lambda v: v == 0, "Mirostat sampling is not supported (0 = off)"),
    # A stage's parameters ask for nothing while the stage is off.
    "mirostat_tau": (lambda v: _is_number(v), "must be a number"),
    "mirostat_eta": (lambda v: _is_number(v), "must be a number"),
    "tfs_z": (lambda v: v == 1, "tail-free sampling is not supported (1 = off)"),
    "penalize_newline": (lambda v: v is False, "no newline penalty is applied here"),
    # Nothing here truncates a prompt, so there is nothing for num_keep to keep.
    "num_keep": (lambda v: _is_int(v), "must be an integer"),
    "logits_all": (lambda v: v is False, "not supported"),
    "vocab_only": (lambda v: v is False, "not supported: a model here loads its weights"),
    "embedding_only": (lambda v: v is False, "a model here is loaded whole (use /api/embed)"),
}

#: How Ollama loads a model. They change how fast, not what is answered; the
#: server's configuration decides how its models load, so they are accepted
#: and not applied (docs/ollama-api.md).
LOAD_OPTIONS: Final = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "use_mmap",
        "use_mlock",
        "num_thread",
    }
)

#: The Go duration units ``keep_alive`` may be written in, in seconds.
_UNITS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION: Final = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def bad_request(message: str, code: str = "bad_request") -> ApiError:
    """A 400 (Ollama writes every refusal as ``{"error": message}``)."""
    return ApiError(HTTPStatus.BAD_REQUEST, message, code)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_options(value: Any, limits_max_tokens: int) -> tuple[dict[str, Any], int | None]:
    """``options`` → the ``generate`` frame's sampler fields, and ``num_ctx``
    (None: not given) for the route to check against the model.

    ``num_predict`` -1 (no limit) and -2 (until the context is full) are the
    server's ``limits.max_tokens``; 0 and other negatives are refused. ``seed``
    -1 is Ollama's "random": no seed. Values are checked by the frame's own
    parser afterwards (ranges, types), its messages in Ollama's names."""
    if not isinstance(value, Mapping):
        raise bad_request("options: must be an object")
    frame: dict[str, Any] = {}
    num_ctx: int | None = None
    for name, option in value.items():
        if option is None:
            continue
        if name in SAMPLER:
            frame[SAMPLER[name]] = option
        elif name == "num_ctx":
            if not _is_int(option) or option < 1:
                raise bad_request("options.num_ctx: must be an integer >= 1")
            num_ctx = option
        elif name in NEUTRAL_ONLY:
            neutral, why = NEUTRAL_ONLY[name]
            if not neutral(option):
                raise bad_request(f"options.{name}: {why}", "unsupported_option")
        elif name not in LOAD_OPTIONS:
            raise bad_request(f"options.{str(name)[:64]}: unknown option", "unsupported_option")
    predict = frame.get("max_tokens")
    if predict is not None:
        if not _is_int(predict) or predict == 0 or predict < -2:
            raise bad_request(
                "options.num_predict: must be an integer >= 1, or -1 (no limit) or -2 "
                "(fill the context)"
            )
        if predict < 0:
            frame["max_tokens"] = limits_max_tokens
    if frame.get("seed") == -1:
        del frame["seed"]
    return frame, num_ctx


def check_num_ctx(num_ctx: int | None, model: str, n_ctx: int | None) -> int | None:
    """The bound ``num_ctx`` puts on a request's output (None: none), or a
    refusal: a context larger than the model's cannot be given. A model whose
    context the engine does not say (an upstream) is not checked."""
    if num_ctx is None:
        return None
    if n_ctx is not None and num_ctx > n_ctx:
        raise bad_request(
            f"options.num_ctx: {num_ctx} is more than the context of {model!r}, {n_ctx} tokens"
            " per request (the server's n_ctx for it)",
            "unsupported_option",
        )
    return num_ctx


def parse_keep_alive(value: Any) -> float | None:
    """``keep_alive`` in seconds (the core's): a number of seconds or a Go
    duration (``"5m"``, ``"1h30m"``, ``"0"``); a negative one is "until its
    memory is needed" (-1). None: not given."""
    if value is None:
        return None
    seconds: float
    if _is_number(value):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        seconds = _duration(value.strip())
    else:
        raise bad_request('keep_alive: must be a number of seconds or a duration ("5m", "1h")')
    if not math.isfinite(seconds):
        raise bad_request("keep_alive: must be finite")
    return -1.0 if seconds < 0 else seconds


def _duration(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body in ("0", ""):
        return 0.0
    try:
        return sign * float(body)  # a number of seconds as a string ("300")
    except ValueError:
        pass
    total = 0.0
    position = 0
    for match in _DURATION.finditer(body):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        position = match.end()
    if position != len(body) or position == 0:
        raise bad_request(
            f'keep_alive: {text[:40]!r} is not a duration (a number of seconds, or "5m", "1h30m")'
        )
    return sign * total


def parse_format(value: Any) -> dict[str, Any] | bool | None:
    """``format`` → the core's ``json_schema`` (None: free text): ``"json"`` is
    any JSON object (Ollama's JSON grammar's root), an object is a JSON Schema."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "object"}
    if isinstance(value, dict):
        return value
    raise bad_request('format: must be "json" or a JSON Schema object')


def parse_think(value: Any) -> dict[str, Any]:
    """``think`` → the frame's reasoning fields. ``true``: a think block is
    split off as ``thinking`` (``reasoning_format`` ``auto``); ``false``: the
    model does not think — a think block it opens is closed at once
    (``reasoning_budget_tokens`` 0, enforced by the engine). Effort levels
    (``"high"``, …) map onto nothing here and are refused."""
    if value is None:
        return {}
    if value is True:
        return {"reasoning_format": "auto"}
    if value is False:
        return {"reasoning_format": "auto", "reasoning_budget_tokens": 0}
    if isinstance(value, str):
        raise bad_request(
            f"think: the level {value[:20]!r} is not supported (no effort levels here); "
            "give true or false",
            "unsupported_option",
        )
    raise bad_request("think: must be true or false")

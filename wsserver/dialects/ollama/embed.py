"""Ollama's ``/api/embed`` and ``/api/embeddings`` bodies and answers (sans-I/O).

**``/api/embed``** (Ollama's current endpoint): ``input`` a string or an
array of strings; ``truncate`` (default ``true``, as Ollama's) cuts an input
longer than the model embeds to its first tokens, ``false`` refuses it
naming its index; ``keep_alive`` as for chat; ``options`` as for chat, of
which none changes a vector (the sampler's are accepted and have nothing to
act on, a model's load options are the operator's) except ``num_ctx``,
refused: the longest input here is the server's ``embed_batch``.
``dimensions`` is refused unless null (no model here is trained to give
shorter vectors). The answer's vectors are **L2-normalised**, as Ollama's
are; ``total_duration`` and ``load_duration`` (the wait for the engine: a
load, a free slot) in nanoseconds; ``prompt_eval_count`` the tokens read.

**``/api/embeddings``** (Ollama's older endpoint): one ``prompt``; the
vector **as the model gives it** (Ollama's older endpoint does not
normalise); no ``truncate`` (an input too long is refused).

Either with nothing to embed (``input`` ``""`` or ``[]``; ``prompt`` ``""``)
loads the model — or with ``keep_alive`` 0 unloads it — and answers an empty
list, as Ollama does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ...core.embedding import DEFAULT_LIMITS, Embed, Embedded, EmbedInput, floats_of
from ..api_errors import Fields
from .options import bad_request, parse_keep_alive, parse_options

__all__ = [
    "EMBED_FIELDS",
    "LEGACY_FIELDS",
    "OllamaEmbed",
    "embed_body",
    "legacy_body",
    "normalised",
    "parse_embed",
    "parse_legacy",
]

_DIMENSIONS: Final = (
    "no model here is trained to give shorter vectors: leave it out "
    "(the vectors are the model's own size)"
)

EMBED_FIELDS: Final = Fields(
    honoured=frozenset({"model", "input", "truncate", "keep_alive", "options"}),
    harmless={"dimensions": lambda value: value is None},
    refused={"dimensions": _DIMENSIONS},
)
LEGACY_FIELDS: Final = Fields(
    honoured=frozenset({"model", "prompt", "keep_alive", "options"}),
    harmless={},
    refused={},
)


@dataclass(frozen=True, slots=True)
class OllamaEmbed:
    """One ``/api/embed`` or ``/api/embeddings`` request, checked."""

    #: The model as the client named it (echoed in the answer).
    model: str
    #: The request for the engine; None: nothing to embed (load or unload only).
    embed: Embed | None
    keep_alive: float | None
    #: ``/api/embeddings``: one vector, as the model gives it.
    legacy: bool = False


def _check_fields(obj: dict[str, Any], fields: Fields) -> None:
    for name, value in obj.items():
        reason = fields.refusal(name, value)
        if reason is None:
            continue
        shown = str(name)[:64]
        if reason:
            raise bad_request(f"{shown}: {reason}", "unsupported_option")
        raise bad_request(f"{shown}: unknown field", "unsupported_option")


def _common(obj: dict[str, Any], fields: Fields) -> tuple[str, float | None]:
    _check_fields(obj, fields)
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required")
    options = obj.get("options")
    if options is not None:
        # The sampler's options have nothing to act on in an embedding; load
        # options are the operator's. num_ctx would bound the input: refused.
        _, num_ctx = parse_options(options, 1)
        if num_ctx is not None:
            raise bad_request(
                "options.num_ctx: the longest input a model embeds here is the server's "
                "(backend.llama.embed_batch); leave it out",
                "unsupported_option",
            )
    return model, parse_keep_alive(obj.get("keep_alive"))


def parse_embed(obj: dict[str, Any], request_id: str) -> OllamaEmbed:
    """An ``/api/embed`` body (see the module docstring)."""
    model, keep_alive = _common(obj, EMBED_FIELDS)
    truncate = obj.get("truncate", True)
    if truncate is None:
        truncate = True
    if not isinstance(truncate, bool):
        raise bad_request("truncate: must be true or false")
    value = obj.get("input")
    items: list[Any]
    if value is None or value == "":
        items = []
    elif isinstance(value, str):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request("input: must be a string or an array of strings")
    if len(items) > DEFAULT_LIMITS.max_inputs:
        raise bad_request(
            f"input: {len(items)} items; at most {DEFAULT_LIMITS.max_inputs} per request"
        )
    inputs: list[EmbedInput] = []
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise bad_request(f"input {index}: must be a string")
        if not item:
            raise bad_request(f"input {index} is an empty string")
        inputs.append(item)
    embed = Embed(id=request_id, inputs=tuple(inputs), truncate=truncate) if inputs else None
    return OllamaEmbed(model, embed, keep_alive)


def parse_legacy(obj: dict[str, Any], request_id: str) -> OllamaEmbed:
    """An ``/api/embeddings`` body (see the module docstring)."""
    model, keep_alive = _common(obj, LEGACY_FIELDS)
    prompt = obj.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad_request("prompt: must be a string")
    embed = Embed(id=request_id, inputs=(prompt,)) if prompt else None
    return OllamaEmbed(model, embed, keep_alive, legacy=True)


def normalised(vector: bytes) -> list[float]:
    """A vector scaled to length 1 (a zero vector stays zero), as Ollama's
    ``/api/embed`` answers."""
    values = floats_of(vector)
    norm = math.sqrt(math.fsum(v * v for v in values))
    if norm == 0.0:
        return values
    return [v / norm for v in values]


def _ns(ms: float) -> int:
    return round(ms * 1e6)


def embed_body(
    result: Embedded | None, *, model: str, total_ms: float = 0.0, queued_ms: float = 0.0
) -> bytes:
    """The whole ``/api/embed`` answer (None: nothing was embedded)."""
    vectors = [] if result is None else [normalised(v) for v in result.vectors]
    return orjson.dumps(
        {
            "model": model,
            "embeddings": vectors,
            "total_duration": _ns(total_ms),
            "load_duration": _ns(queued_ms),
            "prompt_eval_count": 0 if result is None else result.prompt_tokens,
        }
    )


def legacy_body(result: Embedded | None) -> bytes:
    """The whole ``/api/embeddings`` answer: the vector as the model gives it."""
    vector = [] if result is None or not result.vectors else floats_of(result.vectors[0])
    return orjson.dumps({"embedding": vector})

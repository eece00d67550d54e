"""Ollama's model endpoints' bodies (sans-I/O): ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``, ``/api/pull``'s progress, and the endpoints
this server does not have.

The asyncio half (:mod:`wsserver.aio.ollama_http`) gathers a model's
:class:`ModelFacts` — from the registry, and for a GGUF from its file and
header (:func:`facts_from_header`) — and these functions write them in
Ollama's shapes:

* a model is listed as ``name:latest`` when its name has no tag (Ollama's
  clients show and send names with one; the route takes either);
* ``details``: ``format`` ``gguf``, ``family`` the architecture,
  ``parameter_size`` the header's size label (else its parameter count,
  written as Ollama writes it: ``268.10M``, ``1.2B``; neither: ``""``), ``quantization_level``
  the name of the header's file type (``Q4_K_M``);
* ``digest`` identifies the file (a SHA-256 of its path, size and time), it
  is **not** the file's hash: hashing gigabytes per listing would cost
  seconds;
* ``capabilities`` are what the engine really does with the model:
  ``completion`` unless the GGUF declares a pooling type (an embedding or
  rerank model); ``embedding`` when ``/api/embed`` serves it (a loaded
  model's engine says; before its load, a GGUF that declares a pooling
  other than rank); ``tools`` when the engine takes tools; ``thinking``
  when the model's chat template has a think block (``<think>``,
  ``enable_thinking`` or ``reasoning_content`` in it); ``vision`` when the
  loaded model's projector encodes images (said once it is loaded:
  docs/images.md). No ``insert``: not supported here yet.

An engine without a file (the fake, an upstream) has empty details and no
size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final

import orjson

from ...pull.progress import Progress
from ..api_errors import ApiError

__all__ = [
    "API_VERSION",
    "HEADER_KEYS",
    "HUB_PREFIXES",
    "PULL_STATUS",
    "QUANTIZATION",
    "UNSUPPORTED",
    "ModelFacts",
    "Running",
    "capabilities",
    "digest_of",
    "facts_from_header",
    "hub_reference",
    "listed_name",
    "parameter_size",
    "ps_body",
    "pull_status",
    "show_body",
    "tags_body",
    "unsupported",
    "version_body",
]

#: The version ``/api/version`` reports: Ollama's API whose shapes this
#: dialect follows (its clients gate features on it: tools, thinking).
API_VERSION: Final = "0.12.0"

#: llama.cpp's ``llama_ftype`` (the header's ``general.file_type``) → its name.
QUANTIZATION: Final[dict[int, str]] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
}

#: The header's keys ``model_info`` and ``details`` are made of (``{arch}.``:
#: the architecture's own, as :func:`wsserver.backends.gguf_meta.read_metadata` reads them).
HEADER_KEYS: Final = frozenset(
    {
        "general.architecture",
        "general.name",
        "general.basename",
        "general.size_label",
        "general.parameter_count",
        "general.file_type",
        "general.quantization_version",
        "{arch}.context_length",
        "{arch}.embedding_length",
        "{arch}.block_count",
        "{arch}.feed_forward_length",
        "{arch}.attention.head_count",
        "{arch}.attention.head_count_kv",
        "{arch}.pooling_type",
        "tokenizer.ggml.model",
        "tokenizer.chat_template",
    }
)

#: The endpoints this server does not have, and why (a 501 naming it).
UNSUPPORTED: Final[dict[str, str]] = {
    "/api/create": "creating models is not supported: serve a GGUF by configuration",
    "/api/copy": "copying models is not supported: give a model more names with aliases",
    "/api/delete": "deleting models is not supported: models are the configuration's",
    "/api/push": "pushing models is not supported",
    "/api/blobs": "blobs (model files uploaded for /api/create) are not supported",
}

#: What Ollama takes as a Hugging Face model (``hf.co/org/repo:QUANT``): the
#: prefixes a pull's name may carry before the Hub's ``org/repo``.
HUB_PREFIXES: Final = ("hf.co/", "huggingface.co/", "https://huggingface.co/")

#: A failed pull's status, by its wire code (docs/models.md, "Errors").
PULL_STATUS: Final[dict[str, int]] = {
    "bad_reference": 400,
    "pull_not_allowed": 403,
    "hub_not_found": 404,
    "download_too_large": 413,
    "disk_full": 507,
}


def unsupported(path: str) -> ApiError | None:
    """A 501 for an endpoint this server does not have (None: not one of them)."""
    for prefix, why in UNSUPPORTED.items():
        if path == prefix or path.startswith(prefix + "/"):
            return ApiError(HTTPStatus.NOT_IMPLEMENTED, f"{prefix}: {why}", "unsupported")
    return None


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What Ollama's model endpoints say about one model."""

    #: Its name as listed (with a tag).
    name: str
    #: The file's bytes (0: no file).
    size: int = 0
    #: The file's time (RFC 3339), None without one.
    modified_at: str | None = None
    digest: str = ""
    family: str = ""
    parameter_size: str = ""
    quantization_level: str = ""
    #: The header's values (keys with the architecture filled in).
    model_info: dict[str, Any] = field(default_factory=dict)
    #: The chat template (Jinja, the GGUF's), "" when it has none.
    template: str = ""
    capabilities: tuple[str, ...] = ("completion",)
    #: Tokens per request (the server's n_ctx for it), None if not known.
    context_length: int | None = None

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf" if self.size else "",
            "family": self.family,
            "families": [self.family] if self.family else None,
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization_level,
        }

    def entry(self) -> dict[str, Any]:
        """Its ``/api/tags`` entry."""
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        }


@dataclass(frozen=True, slots=True)
class Running:
    """A loaded model, for ``/api/ps``."""

    facts: ModelFacts
    #: The memory it holds (weights and KV cache), bytes.
    size: int
    #: When it unloads if nothing asks for it (RFC 3339).
    expires_at: str


def listed_name(name: str) -> str:
    """A model's name as Ollama lists it: with a tag (``:latest`` when it has none)."""
    return name if ":" in name else name + ":latest"


def parameter_size(count: int) -> str:
    """A parameter count as Ollama writes it (its ``format.HumanNumber``):
    billions with one decimal (``1.2B``), millions with two (``268.10M``),
    thousands with none; a whole number without decimals (``7B``)."""
    for unit, scale, decimals in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
        if count >= scale:
            if count % scale == 0:
                return f"{count // scale}{unit}"
            return f"{count / scale:.{decimals}f}{unit}"
    return str(count)


def digest_of(path: str, size: int, mtime_ns: int) -> str:
    """An identifier of a file (its path, size and time), not its hash."""
    return hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()


def capabilities(
    *,
    tools: bool,
    template: str,
    embedding: bool = False,
    encoder: bool = False,
    modalities: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """What a model can be asked for here (see the module docstring);
    ``modalities``: what the loaded model takes in (``"image"``: vision)."""
    if encoder:  # an embedding (or rerank) GGUF: it writes no text
        return ("embedding",) if embedding else ()
    found = ["completion"]
    if embedding:
        found.append("embedding")
    if tools:
        found.append("tools")
    if any(marker in template for marker in ("<think>", "enable_thinking", "reasoning_content")):
        found.append("thinking")
    found += [
        name for kind, name in (("image", "vision"), ("audio", "audio")) if kind in modalities
    ]
    return tuple(found)


def facts_from_header(header: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelFacts` fields a GGUF header gives (``model_info``,
    ``details``, the template)."""
    arch = str(header.get("general.architecture", ""))
    info = {
        key.replace("{arch}", arch): value
        for key, value in header.items()
        if key != "tokenizer.chat_template"
    }
    size_label = header.get("general.size_label")
    count = header.get("general.parameter_count")
    if isinstance(size_label, str) and size_label:
        size = size_label
    elif isinstance(count, int):
        size = parameter_size(count)
    else:
        size = ""
    file_type = header.get("general.file_type")
    template = header.get("tokenizer.chat_template")
    return {
        "family": arch,
        "parameter_size": size,
        "quantization_level": QUANTIZATION.get(file_type, "") if isinstance(file_type, int) else "",
        "model_info": info,
        "template": template if isinstance(template, str) else "",
    }


def tags_body(models: list[ModelFacts]) -> bytes:
    """``/api/tags``: every model served."""
    return orjson.dumps({"models": [m.entry() for m in models]})


def show_body(facts: ModelFacts) -> bytes:
    """``/api/show``: one model."""
    return orjson.dumps(
        {
            "license": "",
            "modelfile": f"# served by wsserver; a model here has no Modelfile\nFROM {facts.name}\n",
            "parameters": "",
            "template": facts.template,
            "details": facts.details(),
            "model_info": facts.model_info,
            "capabilities": list(facts.capabilities),
            "modified_at": facts.modified_at,
        }
    )


def ps_body(running: list[Running]) -> bytes:
    """``/api/ps``: the loaded models."""
    return orjson.dumps(
        {
            "models": [
                {
                    **r.facts.entry(),
                    "size": r.size,
                    "expires_at": r.expires_at,
                    # No GPU figures: what a GPU holds is llama.cpp's to know.
                    "size_vram": 0,
                    "context_length": r.facts.context_length,
                }
                for r in running
            ]
        }
    )


def hub_reference(name: str) -> str:
    """A pull's name as the Hub's reference: ``hf.co/org/repo:Q4_K_M`` (how
    Ollama pulls from Hugging Face) is ``org/repo:Q4_K_M``."""
    for prefix in HUB_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def pull_status(progress: Progress) -> dict[str, Any]:
    """One progress object of a streamed pull: Ollama's ``status`` words, and
    ``total``/``completed`` — the whole pull's bytes, every file counted
    (Ollama's count one layer each; ``digest`` names the file here)."""
    if progress.status == "resolving":
        return {"status": "pulling manifest"}
    if progress.status == "done":
        return {"status": "writing manifest"}
    status = "verifying sha256 digest" if progress.status == "verifying" else "pulling"
    obj: dict[str, Any] = {"status": status}
    if progress.file is not None:
        if status == "pulling":
            obj["status"] = f"pulling {progress.file}"
        obj["digest"] = progress.file
    if progress.total:
        obj.update(total=progress.total, completed=progress.completed)
    return obj


def version_body() -> bytes:
    return orjson.dumps({"version": API_VERSION})

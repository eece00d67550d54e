"""What a GGUF file says about its size in memory, read from its header alone.

The model registry decides whether a model fits the memory budget *before*
loading it, so it needs the KV cache's size without llama.cpp: the layer
count and the attention heads' widths are in the file's metadata. This reads
the header's key/value pairs (GGUF v2/v3: little-endian; arrays are skipped
unless they are the per-layer ``head_count_kv``) and stops as soon as it has
what the estimate needs — it never touches the tensors, so it costs
milliseconds even for a model of many gigabytes (``gguf.GGUFReader`` maps and
indexes every tensor: seconds).

A file that is not a GGUF, or is cut short, raises :class:`ValueError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "KV_ELEMENT_BYTES",
    "GgufHeader",
    "TensorInfo",
    "embedding_context_bytes",
    "kv_cache_bytes",
    "read_header",
    "read_metadata",
]

_MAGIC = b"GGUF"
#: Value types: struct format of the scalar ones (8 = string, 9 = array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
#: More keys than any real model has: a corrupt count is refused, not believed.
_MAX_KEYS = 1 << 20
#: Likewise tensors, and a tensor's dimensions (ggml has at most 4).
_MAX_TENSORS = 1 << 20
_MAX_DIMS = 4


def _read(f: BinaryIO, size: int) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its GGUF header")
    return data


def _unpack(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack("<" + fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    size = _unpack(f, "Q")
    if size > 1 << 30:
        raise ValueError("a GGUF string longer than 1 GiB")
    return _read(f, size).decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _unpack(f, "I"), _unpack(f, "Q")
        if item in _SCALARS and not keep:
            f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
            return None
        values = [_value(f, item, keep) for _ in range(count)]
        return values if keep else None
    raise ValueError(f"unknown GGUF value type {kind}")


def _skip_array(f: BinaryIO) -> int:
    """Read past an array; its length."""
    item, count = _unpack(f, "I"), _unpack(f, "Q")
    if item in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
    else:
        for _ in range(count):
            _value(f, item, False)
    return int(count)


def _begin(f: BinaryIO) -> tuple[int, int]:
    """Check the magic and the version; the tensor and key counts."""
    if _read(f, 4) != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version = _unpack(f, "I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    tensors, keys = _unpack(f, "Q"), _unpack(f, "Q")
    if keys > _MAX_KEYS:
        raise ValueError(f"a GGUF header with {keys} keys")
    if tensors > _MAX_TENSORS:
        raise ValueError(f"a GGUF header with {tensors} tensors")
    return tensors, keys


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor as the header describes it: ggml's ``ne`` (innermost first)."""

    shape: tuple[int, ...]
    ggml_type: int


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """A GGUF file's metadata (arrays of up to ``max_array`` items; longer
    ones are ``None``) and its tensors by name."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


def read_header(path: str | Path, *, max_array: int = 4096) -> GgufHeader:
    """The whole header: every key, and every tensor's name, shape and type.

    For small files whose every tensor matters (a vision projector): the
    header of a text model with a 262k vocabulary is megabytes of token
    strings, skipped here but still read.
    """
    metadata: dict[str, Any] = {}
    tensors: dict[str, TensorInfo] = {}
    with open(path, "rb") as f:
        n_tensors, keys = _begin(f)
        for _ in range(keys):
            key = _string(f)
            kind = _unpack(f, "I")
            if kind == _ARRAY:
                here = f.tell()
                _unpack(f, "I")  # the items' type
                count = _unpack(f, "Q")
                f.seek(here)
                metadata[key] = _value(f, kind, count <= max_array)
            else:
                metadata[key] = _value(f, kind, True)
        for _ in range(n_tensors):
            name = _string(f)
            dims = _unpack(f, "I")
            if dims > _MAX_DIMS:
                raise ValueError(f"tensor {name} has {dims} dimensions")
            shape = tuple(int(_unpack(f, "Q")) for _ in range(dims))
            ggml_type = _unpack(f, "I")
            _unpack(f, "Q")  # its offset in the data section
            tensors[name] = TensorInfo(shape=shape, ggml_type=ggml_type)
    return GgufHeader(metadata=metadata, tensors=tensors)


def read_metadata(path: str | Path, wanted: set[str]) -> dict[str, Any]:
    """The header's values for the keys in ``wanted`` (those present).

    ``general.architecture`` is always read; a ``{arch}.`` prefix in a wanted
    key is filled in with it once known; a ``#`` before a key asks for the
    length of its array (``#tokenizer.ggml.tokens``: the vocabulary's size).
    """
    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        _n_tensors, keys = _begin(f)
        arch = ""
        for _ in range(keys):
            key = _string(f)
            kind = _unpack(f, "I")
            named = key.replace(f"{arch}.", "{arch}.", 1) if arch else key
            if kind == _ARRAY and "#" + named in wanted:
                found["#" + named] = _skip_array(f)
                if arch and wanted <= found.keys():
                    break
                continue
            keep = named in wanted or key == "general.architecture"
            value = _value(f, kind, keep)
            if key == "general.architecture":
                arch = str(value)
            if keep:
                found[named] = value
            if arch and wanted <= found.keys():
                break
    return found


_WANTED = {
    "{arch}.block_count",
    "{arch}.embedding_length",
    "{arch}.attention.head_count",
    "{arch}.attention.head_count_kv",
    "{arch}.attention.key_length",
    "{arch}.attention.value_length",
}


#: Bytes per KV cache element, by ``cache_type_k``/``_v`` (ggml's block sizes:
#: q8_0 is 34 bytes per 32 values, q4_0 18).
KV_ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def kv_cache_bytes(
    path: str | Path, *, cells: int, type_k: str = "f16", type_v: str = "f16"
) -> int:
    """The KV cache of ``cells`` positions (all sequences together) for this
    model, its K and V of these types: an upper bound (sliding-window layers
    are counted in full)."""
    meta = read_metadata(path, set(_WANTED))
    layers = int(meta.get("{arch}.block_count", 0))
    embd = int(meta.get("{arch}.embedding_length", 0))
    heads = int(meta.get("{arch}.attention.head_count", 0) or 1)
    heads_kv: Any = meta.get("{arch}.attention.head_count_kv", heads)
    per_layer = heads_kv if isinstance(heads_kv, list) else [heads_kv] * layers
    key_length = int(meta.get("{arch}.attention.key_length", embd // heads))
    value_length = int(meta.get("{arch}.attention.value_length", embd // heads))
    width = sum(int(h) for h in per_layer[:layers])
    per_cell = width * (
        key_length * KV_ELEMENT_BYTES[type_k] + value_length * KV_ELEMENT_BYTES[type_v]
    )
    return int(per_cell * cells)


def embedding_context_bytes(path: str | Path, *, tokens: int, decode: int, sequences: int) -> int:
    """The memory of a model's embedding context (:mod:`.llama_embed`) for
    inputs of up to ``tokens`` tokens, ``decode`` tokens a decode, and
    ``sequences`` sequences: an upper bound from the header alone. llama.cpp
    sizes its compute buffer for the output head over every position of a
    decode (``decode`` x vocabulary floats: 515 MiB measured for the default
    model at 512, its vocabulary 262,144) and its output buffer for each
    output's logits and vector — a sequence's when llama.cpp pools, every
    position's when the server does (a causal model's inputs in pieces:
    :mod:`.llama_embed_chunks`); the KV cache is ``tokens + decode`` cells.
    An encoder without an output head needs less: it is counted the same."""
    meta = read_metadata(path, {"#tokenizer.ggml.tokens", "{arch}.embedding_length"})
    n_vocab = int(meta.get("#tokenizer.ggml.tokens", 0))
    n_embd = int(meta.get("{arch}.embedding_length", 0))
    compute = decode * (n_vocab + 8 * n_embd) * 4
    output = max(sequences, decode) * (n_vocab + n_embd) * 4
    return compute + output + kv_cache_bytes(path, cells=tokens + decode)

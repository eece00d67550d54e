"""An audio projector GGUF checked from its header before libmtmd loads it.

The audio half of :mod:`.mmproj_check` (see it for why: libmtmd trusts its
file, and ``mtmd_init_from_file`` runs a warm-up encode — for audio, 3,000
mel frames, 30 s — through the graph, where a missing tensor is a null
dereference and a misshapen one a ``GGML_ASSERT`` abort of the process).

Checked: the whisper encoder libmtmd runs for ``ultravox`` and ``qwen2a``
(``tools/mtmd/models/whisper-enc.cpp``; hparams and tensors from
``clip.cpp``'s ``load_hparams``/``load_tensors``): two 1-D convolutions of
kernel 3 over ``num_mel_bins`` channels (the second of stride 2: 3,000 frames
become 1,500 positions), a learned position table of at least 1,500 rows, the
transformer layers (the graph asserts layer 0's norms and its query and value
biases, and that its key has none), then the projector:

* ``ultravox``: positions stacked by ``projector.stack_factor``, RMS norm,
  a SwiGLU linear layer, RMS norm, a linear layer;
* ``qwen2a`` (also a ``qwen2.5o`` file's audio half): an average pool of 2,
  one linear layer with bias.

Every ``a.*`` and ``mm.a.*`` tensor must be one of these: an unexpected one
(a fused ``attn_qkv``, a gate, a layer scale) would change the graph libmtmd
builds, and its shape is not checked here.
"""

from __future__ import annotations

from .gguf_meta import GgufHeader
from .mmproj_needs import Needs, ProjectorError

__all__ = ["AUDIO_TYPES", "MEL_FRAMES", "audio_type", "check_audio"]

#: The audio projector types whose graph's needs this module checks.
AUDIO_TYPES = ("qwen2a", "ultravox")
#: The mel frames of one 30 s window (libmtmd's whisper preprocessor).
MEL_FRAMES = 3000
_POSITIONS = MEL_FRAMES // 2

_A = "clip.audio."
_REQUIRED_INTS = (
    "embedding_length",
    "attention.head_count",
    "feed_forward_length",
    "block_count",
    "projection_dim",
    "num_mel_bins",
)
#: Bounds far above real whisper encoders (large-v3: width 1280, 20 heads,
#: 32 layers, 5120 hidden, 128 mel bins): the warm-up's attention holds
#: 1,500² scores a head.
_MOST = {
    "embedding_length": 4096,
    "attention.head_count": 32,
    "feed_forward_length": 16384,
    "block_count": 64,
    "num_mel_bins": 256,  # libmtmd's own bound
}
_FLOATS = frozenset({0, 1})  # F32, F16
_MATRICES = frozenset({0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14})


def audio_type(meta: dict[str, object]) -> str | None:
    """The audio encoder's projector type as libmtmd reads it (the shared
    key first, then the audio one), ``qwen2.5o`` read as ``qwen2a``."""
    for key in ("clip.projector_type", "clip.audio.projector_type"):
        value = meta.get(key)
        if isinstance(value, str) and value:
            return "qwen2a" if value == "qwen2.5o" else value
    return None


def check_audio(header: GgufHeader, text_width: int | None) -> tuple[str, int]:
    """Check the file's audio encoder; its type and output width.
    :class:`ProjectorError` names every missing or misshapen piece, or a type
    not checked here."""
    kind = audio_type(header.metadata)
    if kind not in AUDIO_TYPES:
        raise ProjectorError(
            f"audio projector type {kind!r} is not one wsserver checks before loading "
            f"(it checks: {', '.join(AUDIO_TYPES)})"
        )
    needs = Needs(header)
    ints = {name: needs.positive(_A + name) for name in _REQUIRED_INTS}
    if not isinstance(needs.meta.get(_A + "attention.layer_norm_epsilon"), float):
        needs.problems.append(f"metadata {_A}attention.layer_norm_epsilon")
    for name, most in _MOST.items():
        if ints[name] > most:
            needs.problems.append(f"metadata {_A}{name} = {ints[name]} (at most {most} taken here)")
    width, heads = ints["embedding_length"], ints["attention.head_count"]
    if width and heads and width % heads:
        needs.problems.append(f"embedding_length {width} is not a multiple of head_count {heads}")
    for key, want in (("attention.head_count_kv", heads), ("attention.head_dim", None)):
        value = needs.meta.get(_A + key)
        if value is not None and (want is None or value != want):
            needs.problems.append(f"metadata {_A}{key} = {value} (whisper's attention has none)")
    stack = 1
    if kind == "ultravox":
        stack = needs.positive(_A + "projector.stack_factor")
        # libmtmd counts ceil(3000 / f) / 2 embeddings, its graph makes
        # ceil(1500 / f): unequal, the encode aborts the process (tried here).
        if stack and (stack > 64 or _POSITIONS % stack):
            needs.problems.append(
                f"metadata {_A}projector.stack_factor = {stack} (a divisor of {_POSITIONS} "
                "up to 64: libmtmd aborts on any other)"
            )
    if needs.problems:  # the shapes below are sized from these
        raise ProjectorError("; ".join(needs.problems))

    mel, ff, layers = ints["num_mel_bins"], ints["feed_forward_length"], ints["block_count"]
    expected: dict[str, tuple[int | None, ...]] = {
        "a.conv1d.1.weight": (3, mel, width),
        "a.conv1d.1.bias": (1, width),
        "a.conv1d.2.weight": (3, width, width),
        "a.conv1d.2.bias": (1, width),
    }
    optional: dict[str, tuple[int | None, ...]] = {}
    for name in ("a.pre_ln", "a.post_ln"):
        optional[name + ".weight"] = optional[name + ".bias"] = (width,)
    for layer in range(layers):
        p = f"a.blk.{layer}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            expected[f"{p}.{part}.weight"] = (width, width)
        for name in (f"{p}.attn_q.bias", f"{p}.attn_v.bias"):
            expected[name] = (width,)
        for norm in ("ln1", "ln2"):
            expected[f"{p}.{norm}.weight"] = expected[f"{p}.{norm}.bias"] = (width,)
        expected[f"{p}.ffn_up.weight"] = (width, ff)
        expected[f"{p}.ffn_down.weight"] = (ff, width)
        optional[f"{p}.attn_out.bias"] = (width,)
        optional[f"{p}.ffn_up.bias"] = (ff,)
        optional[f"{p}.ffn_down.bias"] = (width,)
    for name, shape in expected.items():
        needs.tensor(name, shape)
    for name, shape in optional.items():
        needs.optional(name, shape)
    position = needs.tensor("a.position_embd.weight", (width, None))
    if position and position[1] < _POSITIONS:
        needs.problems.append(
            f"tensor a.position_embd.weight has {position[1]} rows, not {_POSITIONS}"
        )
    names, output = _ultravox(needs, width * stack) if kind == "ultravox" else _qwen2a(needs, width)
    known = set(expected) | set(optional) | set(names) | {"a.position_embd.weight"}
    for name, info in header.tensors.items():
        if not name.startswith(("a.", "mm.a.")):
            continue
        if name not in known:
            needs.problems.append(f"tensor {name} is not one the {kind} graph checked here uses")
            continue
        kinds = _FLOATS if len(info.shape) == 1 or ".conv1d." in name else _MATRICES
        if name == "a.position_embd.weight":
            kinds = _FLOATS
        if info.ggml_type not in kinds:
            needs.problems.append(
                f"tensor {name} has ggml type {info.ggml_type}, not one taken here"
            )
    if output is not None and text_width is not None and output != text_width:
        needs.problems.append(
            f"its audio output width {output} is not the text model's embedding width {text_width}"
        )
    if needs.problems:
        raise ProjectorError("; ".join(needs.problems))
    return kind, output or 0


def _ultravox(needs: Needs, stacked: int) -> tuple[tuple[str, ...], int | None]:
    """Ultravox's projector: RMS norm, SwiGLU linear, RMS norm, linear."""
    needs.tensor("mm.a.norm_pre.weight", (stacked,))
    first = needs.tensor("mm.a.mlp.1.weight", (stacked, None))
    doubled = first[1] if first else None
    hidden = None
    if doubled is not None:
        if doubled % 2:
            needs.problems.append(
                f"tensor mm.a.mlp.1.weight makes {doubled} values, not an even count"
            )
        hidden = doubled // 2
    needs.tensor("mm.a.norm_mid.weight", (hidden,))
    last = needs.tensor("mm.a.mlp.2.weight", (hidden, None))
    names = (
        "mm.a.norm_pre.weight",
        "mm.a.mlp.1.weight",
        "mm.a.norm_mid.weight",
        "mm.a.mlp.2.weight",
    )
    return names, last[1] if last else None


def _qwen2a(needs: Needs, width: int) -> tuple[tuple[str, ...], int | None]:
    """Qwen2-Audio's projector: one linear layer with bias."""
    weight = needs.tensor("mm.a.fc.weight", (width, None))
    output = weight[1] if weight else None
    needs.tensor("mm.a.fc.bias", (output,))
    return ("mm.a.fc.weight", "mm.a.fc.bias"), output

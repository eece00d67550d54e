"""A tiny random-weight audio projector GGUF (a whisper encoder) and test sounds.

It pairs with :func:`tiny_gguf.write_tiny_gguf` (a llama text model of
width 64): libmtmd loads it, runs its warm-up encode (3,000 mel frames) and
turns every 30 s of audio (a shorter sound is padded to 30 s) into
embeddings of width 64 through its own whisper graph
(``tools/mtmd/models/whisper-enc.cpp``): two 1-D convolutions (the second
of stride 2: 3,000 frames become 1,500 positions), the transformer layers,
then the projector —

- ``ultravox``: frames stacked by ``clip.audio.projector.stack_factor``
  (10 here: 1,500 / 10 = 150 embeddings; libmtmd aborts on a factor that does not divide 1,500), RMS norm, a SwiGLU linear
  layer, RMS norm, a linear layer;
- ``qwen2a``: an average pool of 2 (750 embeddings), one linear layer.

The layout (names from ``tools/mtmd/clip-impl.h``; numpy ``(rows, cols)`` is
ggml ``ne = [cols, rows]``): ``clip.has_audio_encoder``,
``clip.projector_type``, ``clip.audio.{embedding_length, feed_forward_length,
block_count, projection_dim, attention.head_count,
attention.layer_norm_epsilon, num_mel_bins}``; ``a.conv1d.{1,2}.{weight,bias}``
(kernels of 3; biases ``ne = [1, width]``), ``a.position_embd.weight``
(1,500 rows), per layer ``a.blk.{i}.{attn_q, attn_k, attn_v, attn_out, ln1,
ln2, ffn_up, ffn_down}`` (no bias on ``attn_k``: the graph asserts that),
``a.post_ln``, and the projector's ``mm.a.*``.

:func:`sine_wav` writes a short mono 16-bit WAV with the ``wave`` module.
Nothing is committed: tests write the files into a temporary directory.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
from tiny_mmproj import TinyTensors, add_tiny_vision, clip_writer, finish

__all__ = ["AUDIO_TOKENS", "sine_wav", "write_tiny_audio_mmproj"]

#: Embeddings one 30 s window becomes, by projector type (the tiny ones here).
AUDIO_TOKENS = {"ultravox": 150, "qwen2a": 750}
#: Positions the warm-up's 3,000 mel frames make after the stride-2 convolution.
N_POSITIONS = 1500


def write_tiny_audio_mmproj(
    path: str | Path,
    *,
    projector_type: str = "ultravox",
    text_width: int = 64,
    width: int = 32,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 64,
    n_mel: int = 16,
    stack: int = 10,
    positions: int = N_POSITIONS,
    seed: int = 2468,
    omit: tuple[str, ...] = (),
    extra: dict[str, tuple[int, ...]] | None = None,
    vision: bool = False,
    with_vision: bool = False,
) -> Path:
    """Write the tiny audio projector to ``path`` and return it.

    ``omit`` leaves out every tensor or metadata key whose name starts with
    one of its entries; ``extra`` adds tensors (name: numpy shape) — how the
    tests build the malformed projectors that must be refused before
    libmtmd sees them. ``vision`` sets ``clip.has_vision_encoder`` too
    (without a vision encoder's tensors: such a file must be refused);
    ``with_vision`` writes the tiny LLaVA vision encoder beside the audio one
    (``tests/tiny_mmproj.py``), the types under ``clip.vision.projector_type``
    and ``clip.audio.projector_type`` as mixed files have them.
    """
    path = Path(path)
    writer = clip_writer(path, "wsserver-tiny-test-audio-mmproj")
    out = TinyTensors(writer, np.random.default_rng(seed), omit)
    if with_vision:
        flags = ("clip.has_", "clip.projector_type")
        add_tiny_vision(writer, text_width=text_width, omit=flags)
    scalars: list[tuple[str, object]] = [
        ("clip.has_vision_encoder", vision or with_vision),
        ("clip.has_audio_encoder", True),
        ("clip.audio.projector_type" if with_vision else "clip.projector_type", projector_type),
        ("clip.audio.embedding_length", width),
        ("clip.audio.feed_forward_length", n_ff),
        ("clip.audio.block_count", n_layer),
        ("clip.audio.projection_dim", text_width),
        ("clip.audio.attention.head_count", n_head),
        ("clip.audio.attention.layer_norm_epsilon", 1e-5),
        ("clip.audio.num_mel_bins", n_mel),
    ]
    if with_vision:
        scalars.append(("clip.vision.projector_type", "mlp"))
    if projector_type == "ultravox":
        scalars.append(("clip.audio.projector.stack_factor", stack))
    out.metadata(scalars)

    out.tensor("a.conv1d.1.weight", (width, n_mel, 3), 0.3)
    out.tensor("a.conv1d.1.bias", (width, 1), 0.05)
    out.tensor("a.conv1d.2.weight", (width, width, 3), 0.2)
    out.tensor("a.conv1d.2.bias", (width, 1), 0.05)
    out.tensor("a.position_embd.weight", (positions, width), 0.3)
    for layer in range(n_layer):  # a whisper encoder's attn_k has no bias
        out.encoder_layer(f"a.blk.{layer}", width, n_ff, k_bias=False)
    out.norm("a.post_ln", width)
    # Large enough that the sound's embeddings move the text model's output.
    if projector_type == "ultravox":
        stacked, hidden = width * stack, 64
        out.norm("mm.a.norm_pre", stacked, bias=False)
        out.tensor("mm.a.mlp.1.weight", (2 * hidden, stacked), 0.5)
        out.norm("mm.a.norm_mid", hidden, bias=False)
        out.tensor("mm.a.mlp.2.weight", (text_width, hidden), 0.8)
    else:
        out.tensor("mm.a.fc.weight", (text_width, width), 1.0)
        out.tensor("mm.a.fc.bias", (text_width,), 0.1)
    for name, shape in (extra or {}).items():
        out.tensor(name, shape, 0.1)

    return finish(writer, path)


def sine_wav(
    frequency: float = 440.0, *, seconds: float = 1.0, rate: int = 16000, channels: int = 1
) -> bytes:
    """A sine tone as a 16-bit PCM WAV file's bytes."""
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.5 * np.sin(2 * np.pi * frequency * t) * 32767).astype("<i2")
    if channels > 1:
        samples = np.repeat(samples[:, None], channels, axis=1).reshape(-1)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return out.getvalue()

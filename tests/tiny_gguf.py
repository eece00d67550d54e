"""A tiny random-weight llama GGUF for tests, written with the ``gguf`` package.

The model is a real llama graph (2 layers, 64-dim, 4 heads, SwiGLU, RoPE) that
llama.cpp loads and runs at thousands of tokens per second, so tests exercise
the real backend — tokenizer, decode, KV cache, abort callback, sampler —
without the 240 MB default model. Its weights are random (seeded), so its
output is gibberish, but deterministic for a given prompt at temperature 0 and
clearly dependent on the whole context (attention is not degenerate).

The vocabulary is SentencePiece-style ("llama" tokenizer): ``<unk>``, ``<s>``,
``</s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, the printable ASCII
characters, and a few hundred merged pieces learned from a small English text.
It has **no** non-ASCII pieces, so every non-ASCII character the model emits
arrives as two to four byte tokens: exactly the split-character case the text
assembler has to get right.

Nothing is committed: tests write the file into a temporary directory.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

__all__ = ["write_tiny_gguf"]

_SPACE = "\u2581"  # SentencePiece's visible space

_CORPUS = """
The capital of France is Paris. The quick brown fox jumps over the lazy dog.
Once upon a time there was a small model that streamed tokens to every client
without pause, and the server kept memory bounded while the sockets waited.
Stop means stop: the producer thread exits, the queue is drained, the context
is free for the next request. Hello world, hello server, hello client.
In the beginning the text was short, and then it was long, and then it ended.
"""


def _learn_pieces(corpus: str, merges: int) -> list[str]:
    """Greedy BPE merges over the corpus words; returns the merged pieces in order."""
    words = Counter(_SPACE + w for w in corpus.split())
    splits = {w: list(w) for w in words}
    pieces: list[str] = []
    for _ in range(merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            symbols = splits[word]
            for a, b in itertools.pairwise(symbols):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _count = pairs.most_common(1)[0]
        merged = a + b
        pieces.append(merged)
        for word in words:
            symbols = splits[word]
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == a and symbols[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            splits[word] = out
    return pieces


def _vocab(merges: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    scores = [0.0, 0.0, 0.0]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    chars = [_SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    for char in chars:
        tokens.append(char)
        scores.append(-1000.0)  # single characters: merged into longer pieces first
        types.append(gguf.TokenType.NORMAL)
    seen = set(tokens)
    for rank, piece in enumerate(_learn_pieces(_CORPUS, merges)):
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        scores.append(-float(rank))  # SPM merges the highest score first
        types.append(gguf.TokenType.NORMAL)
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(
    path: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 8192,
    merges: int = 200,
    seed: int = 1234,
    chat_template: str | None = None,
    eos_scale: float = 0.5,
    extra_tokens: tuple[tuple[str, gguf.TokenType], ...] = (),
    pooling: gguf.PoolingType | None = None,
    causal: bool | None = None,
    nan_token: int | None = None,
) -> Path:
    """Write the tiny model to ``path`` and return it (about 0.6 MB).

    ``chat_template`` (Jinja, as in Hugging Face tokenizers) is stored as
    ``tokenizer.chat_template`` when given; by default the model has none.
    ``eos_scale`` scales the spread of the end-of-sequence logit: at the
    default 0.5 greedy decoding practically never ends by itself (long-running
    tests need that); at 3 it ends after a handful of tokens.
    ``extra_tokens`` (text, type) come last in the vocabulary, in order: a
    vocabulary's control and user-defined tokens.
    ``pooling`` writes ``llama.pooling_type`` (an embedding model's pooling;
    by default none is declared, as in a generative model) and ``causal``
    ``llama.attention.causal`` (False: an encoder's attention, every token
    seeing every other). ``nan_token``: that token's embedding row is NaN (a
    model that produces NaN for inputs holding it).
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab(merges)
    for text, kind in extra_tokens:
        tokens.append(text)
        scores.append(0.0)
        types.append(int(kind))
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("wsserver-tiny-test-llama")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    if causal is not None:
        writer.add_causal_attention(causal)

    def weight(rows: int, cols: int, scale: float) -> np.ndarray:
        # gguf stores numpy (rows, cols) as ggml ne = [cols, rows]: cols is the input dim.
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    token_embd = weight(n_vocab, n_embd, 1.0)
    if nan_token is not None:  # a broken model: this token's embedding is not a number
        token_embd[nan_token] = np.nan
    writer.add_tensor("token_embd.weight", token_embd)
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        # Large enough that attention patterns are sharp and the output depends
        # on the whole context (the KV-cache tests rely on that).
        writer.add_tensor(f"{prefix}.attn_norm.weight", norm(n_embd))
        writer.add_tensor(f"{prefix}.attn_q.weight", weight(n_embd, n_embd, 0.5))
        writer.add_tensor(f"{prefix}.attn_k.weight", weight(n_head_kv * head_dim, n_embd, 0.5))
        writer.add_tensor(f"{prefix}.attn_v.weight", weight(n_head_kv * head_dim, n_embd, 0.3))
        writer.add_tensor(f"{prefix}.attn_output.weight", weight(n_embd, n_embd, 0.3))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", norm(n_embd))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weight(n_ff, n_embd, 0.2))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(n_ff, n_embd, 0.2))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(n_embd, n_ff, 0.2))
    writer.add_tensor("output_norm.weight", norm(n_embd))
    output = weight(n_vocab, n_embd, 0.25)
    output[2, :] *= eos_scale
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    out = write_tiny_gguf(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf")
    print(out, out.stat().st_size, "bytes")

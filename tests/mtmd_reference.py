"""libmtmd's own way of reading a prompt with images, as the tests' yardstick.

:func:`helper_greedy` loads the text model and its projector on a plain
llama.cpp context, tokenizes the prompt and the images with ``mtmd_tokenize``
(images decoded by ``mtmd_helper_bitmap_init_from_buf``), evaluates every
chunk with ``mtmd_helper_eval_chunks`` — libmtmd's helper: encode each image,
decode its embeddings, decode the text — and then decodes greedily. The
server's engine does the same work its own way, batched beside other
sequences; its greedy tokens must equal these, token for token.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd

__all__ = ["HelperRun", "helper_greedy", "marker", "mtmd_context"]


def marker() -> str:
    """libmtmd's default media marker: where an image goes in the prompt."""
    return mtmd.mtmd_default_marker().decode()


@dataclass(frozen=True)
class HelperRun:
    """What libmtmd's helper path made of a prompt."""

    prompt_tokens: int  # text and image tokens together
    tokens: list[int]  # the greedy continuation
    logprobs: list[float] = field(default_factory=list)  # each token's log-probability


@contextmanager
def mtmd_context(model_path: Path, mmproj_path: Path) -> Iterator[tuple[Any, Any]]:
    """The text model and an mtmd context for its projector; freed after."""
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(model_path).encode(), llama_cpp.llama_model_default_params()
    )
    assert model, "the text model did not load"
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = 1
    params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path).encode(), model, params)
    try:
        assert ctx, "the projector did not load"
        yield model, ctx
    finally:
        if ctx:
            mtmd.mtmd_free(ctx)
        llama_cpp.llama_model_free(model)


def helper_greedy(
    model_path: Path,
    mmproj_path: Path,
    prompt: str,
    images: Sequence[bytes],
    *,
    n: int = 8,
    n_ctx: int = 512,
) -> HelperRun:
    """``n`` greedy tokens after ``prompt`` (its markers replaced by
    ``images``: images or sounds, as libmtmd's helper tells them apart)."""
    with mtmd_context(model_path, mmproj_path) as (model, ctx):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = 512
        params.n_ubatch = 512
        params.n_threads = 1
        params.n_threads_batch = 1
        lctx = llama_cpp.llama_init_from_model(model, params)
        bitmaps: list[Any] = []
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            for data in images:
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
                assert bitmap, "libmtmd could not decode an image"
                bitmaps.append(bitmap)
            text = mtmd.mtmd_input_text()
            encoded = prompt.encode()
            text.text = encoded
            text.text_len = len(encoded)
            text.add_special = True
            text.parse_special = True
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), array, len(bitmaps)) == 0
            prompt_tokens = mtmd.mtmd_helper_get_n_tokens(chunks)
            n_past = llama_cpp.llama_pos(0)
            status = mtmd.mtmd_helper_eval_chunks(
                ctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)
            )
            assert status == 0, f"mtmd_helper_eval_chunks: {status}"
            vocab = llama_cpp.llama_model_get_vocab(model)
            n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
            tokens: list[int] = []
            logprobs: list[float] = []
            for _ in range(n):
                logits = llama_cpp.llama_get_logits_ith(lctx, -1)
                best = max(range(n_vocab), key=lambda j: logits[j])
                tokens.append(best)
                total = sum(math.exp(logits[j] - logits[best]) for j in range(n_vocab))
                logprobs.append(-math.log(total))
                batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(best), 1)
                assert llama_cpp.llama_decode(lctx, batch) == 0
            return HelperRun(prompt_tokens=prompt_tokens, tokens=tokens, logprobs=logprobs)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
            llama_cpp.llama_free(lctx)

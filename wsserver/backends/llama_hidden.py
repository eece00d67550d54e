"""Embedding decodes that end at the hidden states: the output head is not computed.

An embedding context of a generative model makes every position an output,
and llama.cpp computes the output head over each — ``n_vocab`` logits a
position that nobody reads (the vectors are the hidden states before it).
On the default model (a vocabulary of 262,144) that head is half of an
embedding decode: in-process, 128 tokens took 657 ms, and 318 ms stopped
before the head, their vectors equal (2026-12-04, 2 threads;
docs/embeddings.md). llama.cpp's API has no switch for it; llama-server pays it.

The scheduler's evaluation callback (``llama_context_params.cb_eval``) is
asked, node by node, whether the caller wants a node's result; a node it
wants is computed, handed over, and the callback says whether to go on.
:class:`HiddenStop` wants the node that a context without pooling hands
out as its embeddings — llama.cpp names it ``result_embd_pooled`` (its
pooling step, for no pooling, names the final norm's output so), and it is
computed before the head — and says stop there: the graph's later nodes
(the head) are not computed, and llama.cpp copies the embeddings out as
usual (the logits it copies are not read).

Checked a model at a time, not assumed: :meth:`HiddenStop.check` decodes a
few tokens both ways and arms the stop only if the node was there and the
vectors are the same; else every decode runs whole, as before.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any, Final

import llama_cpp
import llama_cpp._ggml as ggml
import numpy as np

__all__ = ["HIDDEN_NODE", "HiddenStop"]

log = logging.getLogger(__name__)

#: The node a context without pooling hands out as its embeddings: the final
#: norm's output (``llm_graph_context::build_pooling`` names it so).
HIDDEN_NODE: Final = b"result_embd_pooled"

#: ``const char * ggml_get_name(const struct ggml_tensor *)``, a handle of our own.
_get_name = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(("ggml_get_name", ggml.libggml))


class HiddenStop:
    """The evaluation callback of an embedding context (see the module docstring).

    Unarmed it wants nothing, and llama.cpp computes the graph in one go, as
    without a callback. Called on the engine thread only (inside ``llama_decode``).
    """

    def __init__(self) -> None:
        #: Whether decodes stop at the hidden states.
        self.armed = False
        #: Whether :meth:`check` has decided ``armed``.
        self.checked = False
        #: Decodes that stopped before the head (the check's; tests).
        self.count = 0
        # Kept here: the context calls it for as long as it lives.
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._call)

    def _call(self, tensor: int | None, ask: bool, _data: Any) -> bool:
        if ask:  # wanted: the hidden states, when armed
            return self.armed and _get_name(tensor) == HIDDEN_NODE
        # It was computed and is in place: stop (llama.cpp reads it as the embeddings).
        self.count += 1
        return False

    def check(self, decode: Callable[[], np.ndarray | None]) -> bool:
        """Arm the stop if it changes nothing: ``decode()`` decodes the same
        few tokens from an empty cache and returns their rows (a copy; None
        if the decode failed), once whole and once armed."""
        self.armed = False
        whole = decode()
        self.armed, before = True, self.count
        cut = decode()
        reached = self.count > before
        self.armed = bool(
            reached
            and whole is not None
            and cut is not None
            and whole.shape == cut.shape
            and np.isfinite(whole).all()
            and np.array_equal(whole, cut)
        )
        self.checked = True
        if self.armed:
            log.info("embedding decodes stop at the hidden states: the output head is not computed")
        else:
            if whole is None or cut is None:
                why = "a decode of the check failed"
            else:
                why = "no such node" if not reached else "not the same vectors"
            log.info("embedding decodes compute the whole graph (%s)", why)
        return self.armed

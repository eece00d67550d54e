"""A causal model's embeddings in chunks: no decode beside the streams longer than the room.

:class:`~.llama_embed.Embedder` decodes whole inputs, because llama.cpp pools
a sequence only when all its tokens are in one micro-batch — so the least an
embedding decode takes is one whole input, and on a generative model that
is slow: llama.cpp computes the output head over every position of a pooled
input (~12 ms a token on the default model, whose vocabulary is 262,144): a
17-token input took 200-700 ms against the ~80 ms of room a step has beside
decoding streams (docs/benchmarks.md, section 18).

A causal model's position sees only the positions before it, so its input
can be read in pieces, like a prompt: :class:`ChunkedEmbedder` makes its
context **without pooling** (each position's vector out: the hidden state
llama.cpp would pool) and takes, each step, as many tokens as the room
holds at the measured cost of one (at least one token) — whole inputs, each
in its own sequence, and at most one input cut at the end, whose cells stay
in its sequence until its next piece, the next step. It pools here, as
llama.cpp would: **mean** (the sum of the positions' vectors over their
count, in float64) or **last** (the last position's). Encoders (non-causal
attention) and cls or rank pooling keep the whole-input decoder.

Each decode ends at those hidden states, before the output head, once a
first check on this context showed that changes nothing
(:mod:`.llama_hidden`): on the default model, half of a decode's time.

A decode aborted by a cancel removes the cut input's new cells (its sum is
only added to after a decode succeeds); a NaN among several inputs keeps
nothing of the decode and runs them again one at a time, as the whole-input
decoder does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import llama_cpp
import numpy as np

from .llama_embed import MAX_SEQUENCES, Embedder, EmbedJob
from .llama_hidden import HiddenStop

__all__ = ["PIECE_TOKENS", "ChunkedEmbedder", "chunked"]

#: The most tokens one decode of pieces holds (its buffers scale with it).
PIECE_TOKENS: Final = 128
#: Tokens of a first piece beside streams, before a token's cost is measured.
_FIRST_PIECE: Final = 16
#: Tokens :meth:`.HiddenStop.check` decodes (twice), from the first input waiting.
_CHECK_TOKENS: Final = 4


def chunked(pooling: int, causal: bool) -> bool:
    """Whether a model's embeddings can be read in pieces (mean or last pooling, causal)."""
    return causal and pooling in (
        llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        llama_cpp.LLAMA_POOLING_TYPE_LAST,
    )


@dataclasses.dataclass
class _Piece:
    """One input's part of a decode: tokens ``start`` to ``end`` in sequence ``seq``."""

    job: EmbedJob
    index: int
    seq: int
    start: int
    end: int


@dataclasses.dataclass
class _Carry:
    """The input cut at the end of the last decode: where it is, what it summed."""

    job: EmbedJob
    index: int
    seq: int
    offset: int
    total: Any  # float64 sum of its positions' vectors (mean pooling)
    last: Any  # its last position's vector (last pooling)


class ChunkedEmbedder(Embedder):
    """Embeddings of a causal model with mean or last pooling, in pieces
    within the step's room (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Every position's vector is the final norm's output, before the head.
        self.hidden = HiddenStop()
        self._carry: _Carry | None = None
        #: The sequences the last decode used (cleared before the next, but the carry's).
        self._used: set[int] = set()

    def decode_tokens(self) -> int:
        # Pieces: llama.cpp's buffers scale with a decode's tokens (the output
        # head over each, every position's logits kept): a quarter of
        # embed_batch's (~260 MiB on the default model, not ~1 GiB).
        return min(self.batch_tokens, PIECE_TOKENS)

    def _context_cells(self) -> int:
        # The cut input's cells stay while the next decode's tokens go in.
        return self.batch_tokens + self.decode_tokens()

    def _context_pooling(self) -> int:
        return int(llama_cpp.LLAMA_POOLING_TYPE_NONE)

    def _eval_callback(self) -> Any:
        return self.hidden.callback

    def _work(self, room_s: float | None) -> None:
        # Unmeasured beside streams: one input's first piece prices the decodes.
        unmeasured = room_s is not None and not self.cost.measured
        most = 1 if self._solo > 0 or unmeasured else MAX_SEQUENCES
        if not self.hidden.checked and self._carry is None:
            self.hidden.check(self._check_decode)
        pieces = self._pieces(self._budget(room_s), most)
        if not pieces:
            return
        ctx = self._ctx
        memory = llama_cpp.llama_get_memory(ctx)
        if self._carry is None:
            # Data too: a freed cell's NaN would reach the next decode through
            # the masked attention (0 times NaN).
            llama_cpp.llama_memory_clear(memory, True)
        else:
            for seq in self._used - {self._carry.seq}:
                llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
        self._used = {piece.seq for piece in pieces}
        batch = self._batch
        batch.clear()
        for piece in pieces:
            tokens = piece.job.tokens[piece.index]
            for pos in range(piece.start, piece.end):
                batch.add(tokens[pos], pos, piece.seq, True)
        n = batch.n
        jobs = [piece.job for piece in pieces]
        if not self._run_decode(jobs, len(pieces), n, room_s):
            self._undo(pieces)
            return
        rows = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(ctx), shape=(n, self.n_embd))
        self._solo = max(0, self._solo - 1)
        if not np.isfinite(rows).all():
            # A NaN reaches every input of the decode and stays in the cells'
            # data: nothing is kept, the cut input starts again, and with several
            # inputs they run again one a decode, so the refusal names the one.
            self._carry = None
            llama_cpp.llama_memory_clear(memory, True)
            if len(pieces) > 1:
                self._solo = len(pieces)
                return
        row = 0
        for piece in pieces:
            part = rows[row : row + piece.end - piece.start].astype(np.float64)
            row += piece.end - piece.start
            self._take(piece, part)

    def _check_decode(self) -> Any:
        """For :meth:`.HiddenStop.check`: the first waiting input's first few
        tokens decoded from an empty cache, their rows (None: it failed)."""
        job = next(j for j in self._jobs if j.done < len(j.tokens))
        tokens = job.tokens[job.done][:_CHECK_TOKENS]
        batch = self._batch
        batch.clear()
        for pos, token in enumerate(tokens):
            batch.add(token, pos, 0, True)
        memory = llama_cpp.llama_get_memory(self._ctx)
        llama_cpp.llama_memory_clear(memory, True)
        status = llama_cpp.llama_decode(self._ctx, batch.ready())
        rows = llama_cpp.llama_get_embeddings(self._ctx) if status == 0 else None
        got = None if not rows else np.ctypeslib.as_array(rows, shape=(len(tokens), self.n_embd))
        llama_cpp.llama_memory_clear(memory, True)
        return None if got is None else got.copy()

    def _budget(self, room_s: float | None) -> int:
        """Tokens this decode takes: what one holds, or the room's worth."""
        if room_s is None:
            return self.decode_tokens()
        fits = self.cost.tokens_within(room_s, self.decode_tokens())
        return _FIRST_PIECE if fits is None else fits

    def _pieces(self, budget: int, most: int) -> list[_Piece]:
        """The carried input's next piece first, then whole inputs in order,
        the last one cut where the budget ends."""
        carry = self._carry
        if carry is not None and (carry.job.cancelled or carry.job.submission.done):
            self._carry = carry = None
        pieces: list[_Piece] = []
        used = 0
        if carry is not None:
            length = len(carry.job.tokens[carry.index])
            end = min(length, carry.offset + budget)
            pieces.append(_Piece(carry.job, carry.index, carry.seq, carry.offset, end))
            used = end - carry.offset
            if end < length:
                return pieces
        free = [s for s in range(MAX_SEQUENCES) if carry is None or s != carry.seq]
        for job in self._jobs:
            if job.cancelled or job.submission.done:
                continue
            first = job.done + (1 if carry is not None and carry.job is job else 0)
            for index in range(first, len(job.tokens)):
                if used >= budget or len(pieces) >= most or not free:
                    return pieces
                length = len(job.tokens[index])
                end = min(length, budget - used)
                pieces.append(_Piece(job, index, free.pop(0), 0, end))
                used += end
                if end < length:
                    return pieces  # cut: carried to the next decode
        return pieces

    def _undo(self, pieces: list[_Piece]) -> None:
        """A decode kept nothing: the carried input's new cells go."""
        carry = self._carry
        if carry is not None:
            memory = llama_cpp.llama_get_memory(self._ctx)
            llama_cpp.llama_memory_seq_rm(memory, carry.seq, carry.offset, -1)

    def _take(self, piece: _Piece, part: Any) -> None:
        job = piece.job
        if job.cancelled or job.submission.done:
            if self._carry is not None and self._carry.job is job:
                self._carry = None
            return
        if not np.isfinite(part).all():
            self._carry = None
            self._fail(
                job,
                "bad_request",
                f"input {piece.index}: the model produced a value that is not a number "
                "(NaN or infinity) for it",
            )
            return
        carry = self._carry
        if piece.start > 0 and carry is not None:
            total, last = carry.total + part.sum(axis=0), part[-1]
        else:
            total, last = part.sum(axis=0), part[-1]
        length = len(job.tokens[piece.index])
        if piece.end < length:
            self._carry = _Carry(job, piece.index, piece.seq, piece.end, total, last)
            return
        self._carry = None
        mean = self.pooling == llama_cpp.LLAMA_POOLING_TYPE_MEAN
        vector = total / length if mean else last
        job.vectors.append(np.asarray(vector, dtype="<f4").tobytes())
        self.stats["inputs"] += 1
        job.done = piece.index + 1
        if job.done == len(job.tokens):
            self._finish(job)

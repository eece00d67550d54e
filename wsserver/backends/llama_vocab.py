"""A loaded model's vocabulary: text → tokens → bytes, as llama-cpp-python makes them.

:class:`Vocabulary` tokenizes exactly as llama-cpp-python's
``create_completion`` does (BOS, then the text with special tokens parsed;
a logit bias's plain text without), maps tokens to their raw bytes
(``llama_token_to_piece``: a byte token is a single byte, perhaps half a
character; a token that is not text, :mod:`.token_text`, to none) for the
engine's :class:`~wsserver.core.textstream.TextAssembler`, and finds the tokens that close a think block whose budget is spent.
Reading the vocabulary is safe beside the engine thread.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp

from ..shaping.reasoning import FORCED_CLOSE
from .token_text import is_text

__all__ = ["Vocabulary"]

#: The token attributes llama.cpp renders as nothing with ``special=false``.
_TEXTLESS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN


class Vocabulary:
    """The tokenizer of one loaded ``LlamaModel``."""

    __slots__ = ("_model", "_pieces", "bos")

    def __init__(self, model: Any) -> None:
        self._model = model
        self._pieces: dict[int, bytes] = {}
        bos = model.token_bos()
        cls_token = model.token_cls()
        first = cls_token if cls_token != -1 else bos
        #: What a prompt (not a chat template's render) starts with.
        self.bos: list[int] = [first] if model.add_bos_token() and first != -1 else []

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        """``text``'s tokens, special tokens parsed (a prompt, a render)."""
        return list(self._model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))

    def tokenize_text(self, text: str) -> list[int]:
        """Plain text's tokens (no BOS, special tokens not parsed): a logit bias's text."""
        return list(self._model.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def piece(self, token: int) -> bytes:
        """A token's raw bytes (a byte token is one byte, maybe half a character)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.read_piece(token)
        return piece

    def read_piece(self, token: int) -> bytes:
        """:meth:`piece`, not cached (a pass over the whole vocabulary): the
        token's bytes, or none for a token that is not text (:mod:`.token_text`)."""
        vocab = self._model.vocab
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            # special=True: every token's whole text, for is_text to judge.
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
            if n >= 0:
                break
            size = -n
        text = buffer.raw[:n]
        attr = llama_cpp.llama_vocab_get_attr(vocab, token)
        control = bool(attr & _TEXTLESS)
        user_defined = bool(attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED)
        return text if is_text(text, control=control, user_defined=user_defined) else b""

    def close_tokens(self) -> tuple[int, ...]:
        """The tokens that end a think block whose budget is spent: exactly
        :data:`~wsserver.shaping.reasoning.FORCED_CLOSE`, special tokens parsed (a
        template's own ``</think>`` token if the vocabulary has one). A
        tokenizer that puts a space before a text (SentencePiece's prefix) is
        given the text after a newline, and the tokens of the newline dropped."""
        target = FORCED_CLOSE.encode()
        tokens = self.tokenize(FORCED_CLOSE, add_bos=False)
        if b"".join(self.read_piece(t) for t in tokens) == target:
            return tuple(tokens)
        after = self.tokenize("\n" + FORCED_CLOSE, add_bos=False)
        for start in range(1, len(after)):
            if b"".join(self.read_piece(t) for t in after[start:]) == target:
                return tuple(after[start:])
        return tuple(tokens)  # the prefix and all: the close is still in it

"""Which tokens of a model's vocabulary are text (sans-I/O).

Like llama-server, whose ``--special`` is off by default, the llama engine
streams only text: a token's piece is what ``llama_token_to_piece`` renders
with ``special=false`` — nothing for the tokens llama.cpp calls *control* or
*unknown* (``<bos>``, ``<start_of_turn>``, ``<|im_end|>``, ``<unused0>``). The
same piece goes into the text, the log-probabilities' token text and what a
grammar sees. Two amendments, decided once per token (:func:`is_text`):

* **The core's markers are text.** Reasoning (``<think>``, ``</think>``) and
  tool calls (``<tool_call>``, ``</tool_call>``, ``[TOOL_CALLS]``,
  ``<|python_tag|>``) are parsed out of the text by the core
  (:mod:`wsserver.shaping.reasoning`, :mod:`wsserver.shaping.tool_calls`). Where a vocabulary
  makes one a control token — Mistral's ``[TOOL_CALLS]``, Llama 3's
  ``<|python_tag|>`` — it is rendered all the same, as llama-server renders a
  chat format's ``preserved_tokens`` (``common/chat.cpp``). In Qwen's
  vocabularies ``<think>`` and ``<tool_call>`` are user-defined tokens: text
  either way. A marker is rendered whether or not the request has tools or
  reasoning; without them it is plain text.
* **Markers a vocabulary calls user-defined are not text.** llama.cpp renders
  every user-defined token as text, and most are (Gemma 3's ``\\n\\n``, runs of
  spaces and tabs, ``<table>``, ``<b>``). But some GGUFs type format and
  modality markers so: Gemma 3 270M's ``<start_of_image>`` and
  ``<end_of_image>`` (the chat page showed ``<start_of_image>`` inside an
  answer; Hugging Face's tokenizer calls them special). A user-defined token
  whose whole text is what llama.cpp's GGUF converter takes for a special
  token (``<|…|>``, also with DeepSeek's fullwidth bars, ``<unused…>``) or one of
  :data:`MODALITY_MARKERS` is not shown. The rule reads token texts only: a
  vocabulary that types another marker as user-defined shows it.

End-of-generation tokens are not looked at here: the engine ends the request
on one, whatever its text.
"""

from __future__ import annotations

import re
from typing import Final

from ..shaping.reasoning import CLOSE, OPEN
from ..shaping.tool_calls import MARKERS as TOOL_CALL_MARKERS

__all__ = ["KEPT_MARKERS", "MODALITY_MARKERS", "is_text"]

#: Rendered as text even as control tokens: the core parses them.
KEPT_MARKERS: Final = frozenset({OPEN, CLOSE, *TOOL_CALL_MARKERS})

#: Markers of an image or audio input that vocabularies type as user-defined
#: (Gemma 3 and 3n): never text of an answer.
MODALITY_MARKERS: Final = frozenset(
    {
        "[multimodal]",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
        "<start_of_audio>",
        "<end_of_audio>",
        "<audio_soft_token>",
    }
)

#: What llama.cpp's converter (``convert_hf_to_gguf.py``,
#: ``does_token_look_special``) takes for a special token by its text.
_LOOKS_SPECIAL: Final = re.compile(r"<\|.*\|>|<\uff5c.*\uff5c>|<unused[0-9]*>", re.DOTALL)


def is_text(text: bytes, *, control: bool, user_defined: bool) -> bool:
    """Whether a token whose full text is ``text`` is shown in the output.

    ``control``: llama.cpp calls the token control or unknown;
    ``user_defined``: it calls it user-defined (else it is a normal or a
    byte token, always text).
    """
    if not control and not user_defined:
        return True
    name = text.decode("utf-8", "replace")
    if name in KEPT_MARKERS:
        return True
    if control:
        return False
    return name not in MODALITY_MARKERS and _LOOKS_SPECIAL.fullmatch(name) is None

"""Which tokens are text (wsserver/backends/token_text.py), the rule alone:
the llama engine on it is tests/test_llama_special_tokens.py."""

from __future__ import annotations

import pytest

from wsserver.backends.token_text import is_text


@pytest.mark.parametrize(
    ("text", "control", "user_defined", "shown"),
    [
        # Normal and byte tokens are text, whatever they spell.
        ("Paris", False, False, True),
        ("<start_of_image>", False, False, True),
        # Control tokens are not (llama-server with --special off) ...
        ("<start_of_turn>", True, False, False),
        ("<|im_end|>", True, False, False),
        ("<unused0>", True, False, False),
        # ... except the markers the core parses from the text.
        ("<think>", True, False, True),
        ("</think>", True, False, True),
        ("<tool_call>", True, False, True),
        ("</tool_call>", True, False, True),
        ("[TOOL_CALLS]", True, False, True),
        ("<|python_tag|>", True, False, True),
        # User-defined tokens are text (Gemma 3's newlines, spaces, HTML) ...
        ("\n\n", False, True, True),
        ("    ", False, True, True),
        ("<table>", False, True, True),
        ("</b>", False, True, True),
        ("<think>", False, True, True),
        ("<tool_call>", False, True, True),
        # ... except markers: modality markers, and what llama.cpp's
        # converter takes for special tokens.
        ("<start_of_image>", False, True, False),
        ("<end_of_image>", False, True, False),
        ("[multimodal]", False, True, False),
        ("<|im_start|>", False, True, False),
        ("<\uff5cend\u2581of\u2581sentence\uff5c>", False, True, False),  # DeepSeek's
        ("<unused6241>", False, True, False),
    ],
)
def test_which_tokens_are_text(text: str, control: bool, user_defined: bool, shown: bool) -> None:
    assert is_text(text.encode(), control=control, user_defined=user_defined) is shown

"""The tiny test projector is a real one: libmtmd loads it and it sees.

These tests run libmtmd's own helper path (``tests/mtmd_reference.py``) on the
tiny text model and the tiny projector, with no server: they prove the test
model is fit to prove the server's image plumbing with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp.mtmd_cpp")

from mtmd_reference import helper_greedy, marker
from tiny_gguf import write_tiny_gguf
from tiny_images import gradient_png, solid_png
from tiny_mmproj import IMAGE_TOKENS, write_tiny_mmproj


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-vision")
    return write_tiny_gguf(root / "tiny.gguf"), write_tiny_mmproj(root / "tiny.mmproj.gguf")


def test_an_image_is_sixteen_tokens_and_changes_the_output(pair: tuple[Path, Path]) -> None:
    model, mmproj = pair
    text_only = helper_greedy(model, mmproj, "Look at this", [])
    red = helper_greedy(model, mmproj, f"Look at {marker()} this", [solid_png((255, 0, 0))])
    assert red.prompt_tokens >= text_only.prompt_tokens + IMAGE_TOKENS
    assert red.tokens != text_only.tokens


def test_the_same_image_gives_the_same_output_and_another_image_another(
    pair: tuple[Path, Path],
) -> None:
    model, mmproj = pair
    prompt = f"Look at {marker()} this"
    first = helper_greedy(model, mmproj, prompt, [solid_png((255, 0, 0))])
    again = helper_greedy(model, mmproj, prompt, [solid_png((255, 0, 0))])
    other = helper_greedy(model, mmproj, prompt, [gradient_png()])
    assert first == again
    # Several tokens, not the first: two images may share their first greedy token.
    assert first.tokens != other.tokens


def test_two_images_are_both_consumed(pair: tuple[Path, Path]) -> None:
    model, mmproj = pair
    one = helper_greedy(model, mmproj, f"A {marker()} B", [solid_png((0, 0, 255))])
    two = helper_greedy(
        model, mmproj, f"A {marker()} B {marker()} C", [solid_png((0, 0, 255)), gradient_png()]
    )
    assert two.prompt_tokens - one.prompt_tokens >= IMAGE_TOKENS

"""An embedding decode's price (wsserver/backends/llama_embed_cost.py), sans-I/O.

The costs below are the default model's, measured (2 threads): ~70 ms a
decode plus ~2.9 ms a token beside three streams. A price a token alone,
learnt from the 128-token decodes that run while nothing else decodes, put
a 42-token piece at 145 ms that took 192: these tests check the fitted line
sizes every piece within its room.
"""

from __future__ import annotations

import random

import pytest

from wsserver.backends.llama_budget import MIN_ROOM
from wsserver.backends.llama_embed_cost import FORGET, EmbedCost

MS = 1e-3
FIXED, PER_TOKEN = 70 * MS, 2.9 * MS
ROOM = 145 * MS


def cost(tokens: int) -> float:
    return FIXED + PER_TOKEN * tokens


def test_nothing_is_priced_before_a_decode_was_seen() -> None:
    fresh = EmbedCost()
    assert not fresh.measured
    assert fresh.price(10) is None
    assert fresh.tokens_within(ROOM, 128) is None


def test_one_size_seen_is_taken_as_proportional() -> None:
    learnt = EmbedCost()
    for _ in range(3):
        learnt.observe(128, cost(128))
    assert learnt.line() == pytest.approx((0.0, cost(128) / 128))


def test_two_sizes_give_the_fixed_part_and_the_part_a_token() -> None:
    learnt = EmbedCost()
    for tokens in (128, 128, 20, 128, 31):
        learnt.observe(tokens, cost(tokens))
    assert learnt.line() == pytest.approx((FIXED, PER_TOKEN))
    assert learnt.price(25) == pytest.approx(cost(25))


def test_pieces_beside_streams_fit_their_room_after_decodes_alone() -> None:
    """The failure this replaced: 128-token decodes alone first, then pieces
    beside streams. Only the first piece, priced proportionally, may overrun;
    every later one ends within the room and takes all the room allows."""
    learnt = EmbedCost()
    for _ in range(4):
        learnt.observe(128, cost(128))
    overruns = []
    for _ in range(20):
        tokens = learnt.tokens_within(ROOM, 128)
        assert tokens is not None
        overruns.append(cost(tokens) > ROOM)
        learnt.observe(tokens, cost(tokens), learnt.price(tokens))
    assert overruns[0]  # proportional: 42 tokens at 192 ms
    assert not any(overruns[1:])
    assert cost(learnt.tokens_within(ROOM, 128) + 1) > ROOM  # not needlessly small


def test_overruns_shrink_the_pieces_but_not_below_half_the_room() -> None:
    learnt = EmbedCost()
    for tokens in (128, 16, 32, 64):
        learnt.observe(tokens, cost(tokens))
    calm = learnt.tokens_within(ROOM, 128)
    noise = random.Random(7)
    for _ in range(16):
        tokens = learnt.tokens_within(ROOM, 128)
        assert tokens is not None
        learnt.observe(tokens, cost(tokens) + noise.uniform(0, 20 * MS), learnt.price(tokens))
    assert learnt.miss_s > 0
    noisy = learnt.tokens_within(ROOM, 128)
    assert calm is not None and noisy is not None and noisy < calm
    line = learnt.line()
    assert line is not None
    assert line[0] + line[1] * noisy <= ROOM  # still within the room itself
    # A machine too noisy for the bound: half the room is still used.
    for _ in range(16):
        learnt.observe(10, cost(10) + 1.0, learnt.price(10))
    floor = learnt.tokens_within(ROOM, 128)
    line = learnt.line()
    assert line is not None and floor is not None
    assert floor == max(1, int((MIN_ROOM * ROOM - line[0]) / line[1]))


def test_a_line_bent_by_noise_falls_back_to_proportional() -> None:
    learnt = EmbedCost()
    learnt.observe(10, 0.5)  # a slow small decode (noise) ...
    learnt.observe(100, 0.2)  # ... then a quick large one: a negative slope
    fixed, per_token = learnt.line() or (None, None)
    # Seconds over tokens, the older decode weighing less.
    assert fixed == 0.0 and per_token == pytest.approx((0.5 * FORGET + 0.2) / (10 * FORGET + 100))

"""The n-gram drafter of speculative decoding, sans-I/O (wsserver/backends/llama_speculation.py),
and the per-request switch on the wire."""

from __future__ import annotations

import orjson
import pytest

from wsserver.backends.llama_speculation import (
    INDEX_STEP,
    MAX_PAUSE,
    MIN_DRAFT,
    NGRAM_SIZES,
    Drafter,
)
from wsserver.backends.request import GenerationRequest
from wsserver.core.protocol import Generate, Limits, parse_client_frame
from wsserver.dialects.openai.api import ApiError, parse_request
from wsserver.errors import ProtocolError

#: Short n-grams keep these histories short; the defaults are checked apart.
SHORT = (4, 3)


def test_it_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    drafter = Drafter(8, SHORT)
    history = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 8, 1, 2]
    # The last tokens are (..., 1, 2) + 3: "2 3" and "1 2 3" occurred; the
    # longest match, "1 2 3" at the start, is followed by 4, 5, 6, 7, 9, ...
    # (the whole draft at once: a short one costs nearly as much).
    assert drafter.propose(history, 3, limit=8) == [4, 5, 6, 7, 9, 2, 3, 4]
    # Only "0 2 3" matches; its latest occurrence was followed by 4, 8, 1, 2.
    drafter = Drafter(8, SHORT, shortest=4)
    assert drafter.propose([0, 2, 3, 6, 0, 2, 3, 4, 8, 1, 0, 2], 3, limit=4) == [4, 8, 1, 0]


def test_the_longest_ngram_wins_over_a_later_shorter_one() -> None:
    drafter = Drafter(8, SHORT, shortest=2)
    # "7 1 2 3" occurs at the start (then 40); "1 2 3" alone later (then 50).
    history = [7, 1, 2, 3, 40, 41, 9, 1, 2, 3, 50, 51, 7, 1, 2]
    assert drafter.propose(history, 3, limit=2) == [40, 41]


def test_no_match_no_draft_and_two_tokens_are_too_few() -> None:
    drafter = Drafter(8, SHORT)
    assert drafter.propose([1, 2, 3, 4], 5, limit=8) == []
    # "5 3" occurred before, but two tokens match by chance too often.
    assert drafter.propose([5, 3, 9, 1, 2, 4, 5], 3, limit=8) == []
    assert drafter.propose([], 3, limit=8) == []


def test_a_repeating_run_is_drafted_on_up_to_the_limit() -> None:
    drafter = Drafter(16, SHORT, shortest=1)
    drafter.length = 16
    # A run of one token: "7 7 7" matched one position back; the draft
    # reaches the token being decoded, and repeats the run after it.
    assert drafter.propose([7, 7, 7], 7, limit=16) == [7] * 16
    assert drafter.propose([5, 6, 5, 6, 5], 6, limit=5) == [5, 6, 5, 6, 5]
    assert drafter.propose([5, 6, 5, 6, 5], 6, limit=1) == [5]
    assert drafter.propose([5, 6, 5, 6, 5], 6, limit=0) == []
    drafter = Drafter(16, SHORT, shortest=1)
    drafter.length = 3  # the drafter's own length bounds it too
    assert drafter.propose([1, 2, 3, 1, 2], 3, limit=16) == [1, 2, 3]


def test_image_positions_are_never_matched_nor_drafted() -> None:
    drafter = Drafter(8, SHORT)
    drafter.length = 8
    # Image positions are negative ids: the draft stops before one ...
    assert drafter.propose([1, 2, 3, -1, -1, 9, 1, 2], 3, limit=8) == []
    drafter = Drafter(8, SHORT, shortest=1)
    drafter.length = 8
    assert drafter.propose([0, 1, 2, 4, 5, -1, -1, 9, 0, 1], 2, limit=8) == [4, 5]
    # (cut that short, a draft shorter than the shortest is none)
    assert Drafter(8, SHORT, shortest=3).propose([0, 1, 2, 4, 5, -1, -1, 9, 0, 1], 2, 8) == []
    # ... and an n-gram across one is not a key.
    drafter = Drafter(8, SHORT)
    assert drafter.propose([7, -1, 4, 5, 9, 7, -1], 4, limit=8) == []


def test_the_index_grows_with_the_history() -> None:
    drafter = Drafter(8, SHORT, shortest=4)
    history = [1, 2, 3, 4]
    assert drafter.propose(history, 9, limit=8) == []
    history += [9, 1, 2]
    assert drafter.propose(history, 3, limit=4) == [4, 9, 1, 2]


def test_drafts_start_at_the_shortest_and_grow_to_draft_max_while_accepted() -> None:
    drafter = Drafter(32, SHORT)
    assert drafter.length == MIN_DRAFT == 8
    drafter.verified(8, 8)
    drafter.verified(16, 16)
    assert drafter.length == 32
    drafter.verified(32, 20)  # paid (more than half), not all: the length stays
    assert (drafter.length, drafter.pause, drafter.misses) == (32, 0, 0)
    drafter.verified(32, 3)  # did not pay: halved
    assert drafter.length == 16
    assert (drafter.drafted, drafter.accepted) == (88, 47)
    assert Drafter(2).length == 2  # never longer than draft_max
    # A limit below the shortest draft: none.
    assert Drafter(16).propose([*range(100, 120), *range(100, 110)], 110, limit=7) == []


def test_by_default_only_long_matches_draft() -> None:
    """Chance matches of a few tokens draft nothing (a draft costs a step
    whole on a large vocabulary); eight tokens seen before do."""
    assert NGRAM_SIZES == (12, 8)
    passage = list(range(100, 140))
    # "... 1 2 3" + 4: a 4-gram seen before, no longer one.
    assert Drafter(16).propose([1, 2, 3, 4, 50, 51, 9, 1, 2, 3], 4, limit=16) == []
    # The passage's first 8 tokens again: its continuation, whole.
    history = [7, *passage, 8, 9, *passage[:7]]
    assert Drafter(16).propose(history, passage[7], limit=16) == passage[8:16]  # the first: 8
    # 12 tokens win over a later 8: the passage, then its first 8 tokens
    # followed by something else, then its first 12 again.
    history = [*passage, *passage[:8], 1, 2, 3, 5, *passage[:11]]
    assert Drafter(4).propose(history, passage[11], limit=4) == passage[12:16]
    # ... and with only 8 tokens matching, the later occurrence's continuation.
    history = [*passage, *passage[:8], 1, 2, 3, 5, 6, *passage[:7]]
    assert Drafter(4).propose(history, passage[7], limit=4) == [1, 2, 3, 5]


def test_rejected_drafts_shrink_and_pause_for_longer_each_time() -> None:
    drafter = Drafter(16, SHORT, shortest=2)
    drafter.length = 16
    history = [1, 2, 3, 4, 5, 1, 2]
    pauses = []
    for _ in range(9):
        drafter.verified(4, 1)  # did not pay
        pauses.append(drafter.pause)
        # While paused, no draft even though "1 2 3" matches.
        for _ in range(drafter.pause):
            assert drafter.propose(history, 3, limit=8) == []
        assert drafter.propose(history, 3, limit=8) != []
    assert pauses == [1, 3, 7, 15, 31, 63, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE]
    assert drafter.length == 2
    drafter.verified(2, 1)  # paid again: no pause, the misses forgotten
    assert (drafter.pause, drafter.misses) == (0, 0)
    drafter.verified(2, 0)
    assert drafter.pause == 1


# ---------------------------------------------------------------- the per-request switch


def test_speculative_on_a_generate_and_an_openai_body() -> None:
    limits = Limits(max_prompt_chars=100, max_tokens=50)

    def frame(**fields: object) -> Generate:
        parsed = parse_client_frame(
            orjson.dumps({"type": "generate", "id": "g", "prompt": "hi", **fields}).decode(),
            limits,
        )
        assert isinstance(parsed, Generate)
        return parsed

    def speculates(generate: Generate) -> bool:
        return GenerationRequest.from_frame(generate, default_max_tokens=8).speculative

    assert speculates(frame()) and speculates(frame(speculative="auto"))
    assert not speculates(frame(speculative="off"))
    for wrong in ("on", True, None, 1):
        with pytest.raises(ProtocolError, match="'speculative' must be"):
            frame(speculative=wrong)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "speculative": "off"}
    api = parse_request("chat", orjson.dumps(body), "r1", limits)
    assert api.generate.speculative == "off"
    body["speculative"] = "fast"
    with pytest.raises(ApiError, match="speculative"):
        parse_request("chat", orjson.dumps(body), "r1", limits)


def test_a_long_history_is_indexed_a_bounded_part_a_step() -> None:
    """A long prompt is not indexed in one stall of the engine thread: at
    most INDEX_STEP positions a call, no draft until all are, then the
    latest occurrence's continuation as if indexed at once."""
    passage = list(range(1000, 1040))
    history = [*passage, *[7] * (2 * INDEX_STEP), *passage[:10]]
    drafter = Drafter(16)
    calls = 0
    while (draft := drafter.propose(history, passage[10], limit=16)) == []:
        calls += 1
        assert calls < 10
    assert calls == len(history) // INDEX_STEP
    assert draft == passage[11:19]

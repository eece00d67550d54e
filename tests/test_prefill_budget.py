"""The prefill budget: how many prompt tokens a step takes beside decoding
sequences, from the step durations the engine measured (sans-I/O: the
durations are given here; tests/test_llama_batch.py runs it in the engine)."""

from __future__ import annotations

import pytest

from wsserver.backends.llama_budget import PrefillBudget

MS = 0.001


def ingest(budget: PrefillBudget, decode_s: float, token_s: float, steps: int) -> list[int]:
    """Shares over ``steps`` mixed steps on a machine where a step costs
    ``decode_s`` plus ``token_s`` per prompt token; the step durations go back
    to the budget as the engine reports them."""
    shares = []
    for _ in range(steps):
        share = budget.share(3)
        shares.append(share)
        budget.observe(3, share, decode_s + share * token_s)
    return shares


def test_nobody_decoding_the_prompt_takes_whole_batches() -> None:
    budget = PrefillBudget(2.0, n_batch=512)
    assert budget.share(0) == 512


def test_the_share_fills_the_budget_from_measured_costs() -> None:
    budget = PrefillBudget(2.0, n_batch=512)
    budget.observe(3, 0, 50 * MS)  # the three streams' step alone
    budget.observe(0, 512, 512 * 1.5 * MS)  # an earlier prompt, alone: optimistic
    shares = ingest(budget, 50 * MS, 2 * MS, steps=60)
    # (2.0 - 1) x 50 ms of room at 2 ms a token: 25 tokens, once measured
    # (and the first step's miss forgotten); never a step over the budget, not
    # even the first from the optimistic figure.
    assert shares[-1] == 25
    assert all(50 * MS + s * 2 * MS <= 2.0 * 50 * MS * 1.34 for s in shares)
    assert shares[0] == 33  # 50 ms / 1.5 ms: the prompt-only estimate, then corrected


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0, 5.0])
def test_the_step_lasts_at_most_factor_times_the_decode_step(factor: float) -> None:
    budget = PrefillBudget(factor, n_batch=512)
    budget.observe(3, 0, 47 * MS)
    budget.observe(0, 64, 64 * 2 * MS)
    shares = ingest(budget, 47 * MS, 2.7 * MS, steps=60)
    for share in shares[2:]:
        assert 47 * MS + share * 2.7 * MS <= factor * 47 * MS + 1e-9
    share = shares[-1]  # once the first steps' misses are forgotten, it uses the room
    assert 47 * MS + (share + 1) * 2.7 * MS > factor * 47 * MS


def test_the_share_follows_a_prompt_token_growing_dearer_with_its_position() -> None:
    """Attention reads every earlier cell: at the prompt's end a token costs
    more than at its start, and the chunks shrink to keep the step's time."""
    budget = PrefillBudget(2.0, n_batch=512)
    budget.observe(3, 0, 50 * MS)
    budget.observe(0, 100, 100 * 2 * MS)
    early = ingest(budget, 50 * MS, 2 * MS, steps=60)[-1]
    late = ingest(budget, 50 * MS, 4.6 * MS, steps=60)[-1]
    assert early == 25 and late == 10


def test_one_quick_step_does_not_make_the_next_one_huge() -> None:
    budget = PrefillBudget(2.0, n_batch=512)
    budget.observe(3, 0, 50 * MS)
    budget.observe(0, 100, 100 * 2 * MS)
    ingest(budget, 50 * MS, 2 * MS, steps=6)
    budget.observe(3, 25, 40 * MS)  # noise: shorter than the decode step alone
    assert budget.share(3) <= 2 * 25 + 8


def test_unmeasured_then_fixed_chunk() -> None:
    """Before any measurement, and with the budget off (factor 0), the share
    is the fixed chunk (``prefill_chunk``), within ``n_batch``."""
    assert PrefillBudget(2.0, n_batch=512, fixed=64).share(3) == 64
    off = PrefillBudget(0.0, n_batch=512, fixed=48)
    off.observe(3, 0, 50 * MS)
    off.observe(3, 48, 500 * MS)
    assert off.share(3) == 48
    assert PrefillBudget(0.0, n_batch=16, fixed=48).share(1) == 16


def test_a_decode_count_not_yet_measured_uses_a_neighbour_or_the_fixed_chunk() -> None:
    """A decode step of one sequence says little about one of sixteen: sized by
    it, every mixed step looked dear, and the chunks shrank to a token each
    (16 requests arriving together waited 4.7 s for their first token)."""
    budget = PrefillBudget(2.0, n_batch=512, fixed=64)
    budget.observe(2, 0, 40 * MS)
    budget.observe(0, 100, 100 * 2 * MS)
    assert budget.decode_time(3) == pytest.approx(40 * MS)
    assert budget.share(3) == 20
    assert budget.decode_time(16) is None
    assert budget.share(16) == 64
    # A mixed step of an unmeasured count teaches nothing about a prompt token.
    before = budget.token_s
    budget.observe(16, 64, 900 * MS)
    assert budget.token_s == before
    assert budget.share(16) == 64


def test_a_noisy_machine_leaves_a_margin_so_the_bound_holds() -> None:
    """The budget is a bound on what the decoding streams wait for, not an
    average: when the steps' durations scatter around what was predicted, the
    share leaves room for the scatter, and a step that runs long by the usual
    amount still ends within the budget."""
    quiet = PrefillBudget(2.0, n_batch=512)
    noisy = PrefillBudget(2.0, n_batch=512)
    for budget in (quiet, noisy):
        budget.observe(3, 0, 50 * MS)
        budget.observe(0, 100, 100 * 2 * MS)
    ingest(quiet, 50 * MS, 2 * MS, steps=60)
    for step in range(60):  # the same machine, each step 4 ms early or late
        share = noisy.share(3)
        noisy.observe(3, share, 50 * MS + share * 2 * MS + (4 if step % 2 else -4) * MS)
    assert quiet.share(3) == 25
    share = noisy.share(3)
    assert share < 25
    assert 50 * MS + share * 2 * MS + 4 * MS <= 2.0 * 50 * MS  # late by 4 ms: within
    # ... but the prompt still moves when the machine is too noisy to keep it.
    wild = PrefillBudget(2.0, n_batch=512)
    wild.observe(3, 0, 50 * MS)
    wild.observe(0, 100, 100 * 2 * MS)
    wild.misses.extend([1.0] * 16)  # steps a second off their prediction
    assert wild.share(3) == 12  # half the room: 25 ms at 2 ms a token


def test_a_prompts_last_token_is_worth_a_decoding_sequences_part_of_the_step() -> None:
    """The step that ends a prompt computes its logits and samples, as a
    decoding sequence does: the engine leaves that much room in it."""
    budget = PrefillBudget(2.0, n_batch=512)
    assert budget.output_tokens(3) == 0  # nothing measured yet
    budget.observe(3, 0, 45 * MS)
    budget.observe(0, 100, 100 * 2 * MS)
    assert budget.output_tokens(3) == 8  # 15 ms a sequence at 2 ms a token, rounded up
    assert budget.output_tokens(0) == 0
    assert PrefillBudget(0.0, n_batch=512).output_tokens(3) == 0  # the budget off


def test_the_gap_bound_gives_the_prompt_the_rest_of_the_step() -> None:
    """The freeze bound in milliseconds: beside three streams decoding in
    45 ms, a 200 ms bound leaves the prompt 155 ms of every mixed step —
    where twice their step (the bound before issue 40) left it 45 ms. Beside
    one stream in 20 ms, the prompt gets 180 ms: however short the decode
    step, the step lasts the bound, not a multiple of it."""
    twice = PrefillBudget(2.0, n_batch=512)
    gap = PrefillBudget(2.0, n_batch=512, gap_s=200 * MS)
    for budget in (twice, gap):
        budget.observe(3, 0, 45 * MS)
        budget.observe(0, 100, 100 * 2 * MS)
    assert twice.share(3) == 22  # 45 ms of room at 2 ms a token
    assert gap.share(3) == 77  # 200 - 45 = 155 ms of room
    one = PrefillBudget(2.0, n_batch=512, gap_s=200 * MS)
    one.observe(1, 0, 20 * MS)
    one.observe(0, 100, 100 * 2 * MS)
    assert one.share(1) == 90  # 200 - 20 = 180 ms


def test_many_streams_whose_own_step_nears_the_bound_still_let_a_prompt_move() -> None:
    """Sixteen streams decoding in 150 ms leave 50 ms of a 200 ms bound; the
    step may then last ``factor`` times their step (2 x 150 = 300 ms), so the
    prompt still gets 150 ms. With ``factor`` 0 the bound alone holds, the
    prompt's share shrinking to what fits."""
    budget = PrefillBudget(2.0, n_batch=512, gap_s=200 * MS)
    budget.observe(16, 0, 150 * MS)
    budget.observe(0, 100, 100 * 2 * MS)
    assert budget.share(16) == 75  # 300 - 150 ms of room
    strict = PrefillBudget(0.0, n_batch=512, gap_s=200 * MS)
    strict.observe(16, 0, 150 * MS)
    strict.observe(0, 100, 100 * 2 * MS)
    assert strict.share(16) == 25  # 200 - 150 ms
    assert not strict.off
    assert PrefillBudget(0.0, n_batch=512, fixed=48).off


def test_the_gap_bound_holds_while_the_prompt_grows_dearer() -> None:
    """Over a long prompt whose tokens grow dearer with their position, every
    mixed step once measured ends within the 200 ms bound, and the chunks
    shrink as the tokens' cost grows."""
    budget = PrefillBudget(2.0, n_batch=512, gap_s=200 * MS)
    budget.observe(3, 0, 45 * MS)
    budget.observe(0, 64, 64 * 2 * MS)
    shares = []
    for step in range(80):
        token_s = (2.0 + step * 0.03) * MS  # 2 ms at the start, 4.4 ms at the end
        share = budget.share(3)
        shares.append(share)
        seconds = 45 * MS + share * token_s
        budget.observe(3, share, seconds)
        if step >= 3:  # after the first steps' estimate settles
            assert seconds <= 200 * MS * 1.02, (step, share, seconds)
    assert shares[-1] < shares[5]


def test_drafts_beside_others_fit_in_the_gap_and_one_stream_drafts_freely() -> None:
    """Speculative drafts (backends/llama_speculation.py) in a decode-only
    step: one sequence alone is bounded by its drafter only; beside others,
    every draft token together fits in what the gap leaves, each at a
    decoding sequence's cost a token; none until that step is measured."""
    budget = PrefillBudget(2.0, n_batch=512, gap_s=200 * MS)
    assert budget.draft_rows(1) is None
    assert budget.draft_rows(3) == 0  # not measured yet
    budget.observe(3, 0, 45 * MS)
    # 200 - 45 = 155 ms of room at 15 ms a token (45 ms for three).
    assert budget.draft_rows(3) == 10
    budget.observe(4, 0, 80 * MS)
    assert budget.draft_rows(4) == 6  # 120 ms at 20 ms a token
    # The budget off (a fixed chunk a step): no time bound on drafts either.
    assert PrefillBudget(0.0, n_batch=512).draft_rows(3) is None


def test_embedding_work_gets_its_turn_from_prompts_and_keeps_the_room_otherwise() -> None:
    """``embed_room``: while a prompt is prefilled, embedding work decodes only
    on its turn — then at least its smallest piece, even after an overrun (so
    the prompts it held up are held up once); beside decoding streams alone it
    takes the room the budget leaves, and nothing after an overrun."""
    from types import SimpleNamespace

    from wsserver.backends.llama_batching import embed_room

    budget = PrefillBudget(2.0, n_batch=512, gap_s=200 * MS)
    budget.observe(3, 0, 50 * MS)  # three streams' decode-only step
    stream = SimpleNamespace(
        next_token=1, waiting_room=False, fed=5, prompt=[0] * 5, cancelled=False
    )
    prompt = SimpleNamespace(
        next_token=None, waiting_room=False, fed=0, prompt=[0] * 900, cancelled=False
    )
    beside, with_prompt = [stream] * 3, [stream, stream, stream, prompt]
    room = budget.room(3)
    assert room > 0
    assert embed_room(beside, budget, 50 * MS, turn=False) == (True, pytest.approx(room))
    assert embed_room(beside, budget, 50 * MS + room + MS, turn=False) == (False, None)
    assert embed_room(with_prompt, budget, 50 * MS, turn=False) == (False, None)
    assert embed_room(with_prompt, budget, 50 * MS, turn=True) == (True, pytest.approx(room))
    assert embed_room(with_prompt, budget, 50 * MS + room + MS, turn=True) == (True, 0.0)
    assert embed_room([prompt], budget, 0.0, turn=False) == (False, None)
    assert embed_room([prompt], budget, 0.0, turn=True) == (True, None)  # a whole decode

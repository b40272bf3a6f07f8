"""The cost lines adaptive depth plans on (`costs.py`), fed by hand (no wall clock in a test): the
draft's passes (`LinearCost`) and the target's steps by batch size, with their row blocks
(`BatchCost`). The plan itself is in test_spec_adaptive.py."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.spec_decode.costs import BatchCost, LinearCost, target_line
from pdserve.engine.spec_decode.depth import AdaptiveDepth

from depth_driving import seq_, tile_blocks


def test_a_guessed_draft_line_is_free_until_a_pass_is_measured():
    """The engine's draft line is a guess (`LinearCost(guess=True)`): taken as a measurement, a
    guess dearer than the draft really is made plain decoding win every plan, no pass ran, and
    the line never learnt better. Free until measured, the first plan drafts; the first real pass
    leaves the guess a small share of its weight, so a few cheap passes keep drafting and dear
    ones stop it."""
    def depth(guess: bool) -> AdaptiveDepth:  # the guess: a draft pass dearer than a target step
        return AdaptiveDepth(4, True, LinearCost(0.001, 0.0002), LinearCost(0.002, 0.00005, guess=guess))

    taken_as_measured, guessed = depth(False), depth(True)
    assert taken_as_measured.plan([seq_("a")], [10]) == [0]
    assert guessed.draft_cost.is_guess and guessed.plan([seq_("a")], [10]) == [4]
    for _ in range(4):  # one proposal's passes, each about 20 times cheaper than the guess
        guessed.draft_cost.observe(1, 0.0001)
    assert not guessed.draft_cost.is_guess and guessed.draft_cost(1) < 0.0002
    assert guessed.plan([seq_("a")], [10]) == [4]
    for _ in range(20):  # the passes really are dear: 5 ms each
        guessed.draft_cost.observe(1, 0.005)
    assert guessed.plan([seq_("a")], [10]) == [0]


def test_the_target_cost_takes_no_slope_until_one_size_has_steps_of_two_lengths():
    """The engine's target cost (`target_line`) is a guess until one batch size has steps of two
    lengths: its slope is then 0, so the plan drafts and the first verification measures it, and
    almost only the measured steps count after. A line with the guess as its prior at full weight
    read forty 0.4 ms plain steps as 0.57 ms a token after a short prompt, verification looked as
    dear as plain steps, and depth stayed at 0 for good."""
    cost, as_prior = target_line(), LinearCost(5e-3, 5e-4)
    for _ in range(40):
        cost.observe(1, 0.0004, seqs=1)
        as_prior.observe(1, 0.0004)
    assert cost.is_guess and cost(5) == cost(1)  # verification priced free: the first plan drafts
    draft = LinearCost(0.0, 8e-5)  # measured: 0.08 ms a pass
    seq = seq_("a")
    depth = AdaptiveDepth(4, True, cost, draft)
    depth.record(seq.req_id, 4, 4)  # drafts accepted: alpha near 0.9
    assert depth.plan([seq], [10]) == [4]
    cost.observe(5, 0.0008, seqs=1)  # that verification
    as_prior.observe(5, 0.0008)
    assert not cost.is_guess
    assert cost(1) == pytest.approx(0.0004, rel=0.1) and cost(5) == pytest.approx(0.0008, rel=0.1)
    assert as_prior.b > 0.0005 and as_prior(5) > 0.0025  # the prior's slope
    plans = [AdaptiveDepth(4, True, target, draft) for target in (cost, as_prior)]
    for p in plans:
        p.record(seq.req_id, 4, 4)
    assert plans[0].plan([seq], [10])[0] >= 1 and plans[1].plan([seq], [10]) == [0]  # drafting, against never again


def _per_sequence(seqs: int, n: int) -> float:
    """A step's seconds where each sequence costs 0.15 ms and each row 0.09 ms more (on the demo
    pair a plain step of 8 rows took 2.44 ms, and each draft verified added about 0.1 ms)."""
    return 0.5e-3 + 0.15e-3 * seqs + 0.09e-3 * n


def test_the_target_cost_takes_each_batch_size_apart():
    """Steps of 8 and 32 sequences, plain and verifying, and a batch's last steps (fewer
    sequences, one row each): `BatchCost` predicts each size's steps, its slope the rows' cost
    alone. A line through the same steps takes how sizes differ (each sequence's 0.15 ms) for
    the rows' cost: its slope is a third too steep, and it reads a plain step of 32 rows a
    third cheaper than it is."""
    cost, line = BatchCost(5e-3, 5e-4), LinearCost(5e-3, 5e-4)
    steps = [(8, 8), (8, 16), (8, 32), (32, 32), (32, 64), (32, 160)] + [(s, s) for s in range(1, 8)]
    for _ in range(40):
        for seqs, n in steps:
            cost.observe(n, _per_sequence(seqs, n), seqs=seqs)
            line.observe(n, _per_sequence(seqs, n))
    assert cost.slope == pytest.approx(0.09e-3, rel=0.02)
    for seqs, n in [(8, 8), (8, 24), (8, 40), (32, 32), (32, 128), (3, 3), (3, 9)]:
        assert cost(n, seqs) == pytest.approx(_per_sequence(seqs, n), rel=0.02), (seqs, n)
    assert line.slope > 1.3 * 0.09e-3 and line(32) < 0.7 * _per_sequence(32, 32)
    assert cost(8, 64) == cost(8, 32)  # a size never seen: the nearest seen size's intercept


def test_the_target_cost_by_batch_size_plans_the_depth_the_true_costs_pick():
    """At batch 8 with acceptance about 0.53 (temperature 1 on the demo pair), on per-sequence
    costs: the plan on `BatchCost` picks the depth the true costs pick (one draft a sequence,
    1.07x plain decoding); on a line through the same steps (the batch's last steps among them)
    every row looks dear, and it decodes plain."""
    cost, line = BatchCost(5e-3, 5e-4), LinearCost(5e-3, 5e-4)
    for _ in range(40):
        for seqs, n in [(8, 8), (8, 16), (8, 32), (8, 40)] + [(s, s) for s in range(1, 8)]:
            cost.observe(n, _per_sequence(seqs, n), seqs=seqs)
            line.observe(n, _per_sequence(seqs, n))
    draft = LinearCost(0.25e-3, 0.01e-3)
    seqs = [seq_(f"s{i}") for i in range(8)]
    picks = []
    for target in (cost, line):
        depth = AdaptiveDepth(4, True, target, draft)
        for s in seqs:
            for _ in range(20):
                depth.record(s.req_id, 4, 1)
        picks.append(depth.plan(seqs, [100] * 8, fused=True))
    alpha = depth.alpha("s0")

    def tokens_per_second(k: int) -> float:  # on the true costs
        return 8 * (1 - alpha ** (k + 1)) / (1 - alpha) / (_per_sequence(8, 8 * (k + 1)) + k * draft(8))

    best = max(range(5), key=tokens_per_second)
    assert best == 1 and picks[0] == [best] * 8 and picks[1] == [0] * 8, (alpha, picks)


def test_blocked_cost_prices_a_block_the_line_smooths_over():
    """Steps of a batch of 8 seen at 8 rows (plain) and 32 (three drafts each), costing 80 µs a
    row and 0.4 ms a 16-row block: `BatchCost`, told the block's seconds, predicts 16 and 24
    rows, where a line fit on the same steps reads 16 rows 5% dearer; and its plan at acceptance
    0.53, 0.67 and 0.75 is one draft a sequence, the fastest depth on those costs (16 rows, in
    plain decoding's one block) at each."""
    truth = lambda n: 1e-3 + 80e-6 * n + 0.4e-3 * tile_blocks(n)  # noqa: E731
    blocked = BatchCost(5e-3, 5e-4, blocks=tile_blocks, block_seconds=0.4e-3)
    line = BatchCost(5e-3, 5e-4)
    for _ in range(60):
        for n in (8, 32):
            blocked.observe(n, truth(n), seqs=8)
            line.observe(n, truth(n), seqs=8)
    for n in (8, 16, 24, 32, 40):  # within 3%: the prior keeps a little weight
        assert blocked(n, 8) == pytest.approx(truth(n), rel=0.03), n
    assert line(16, 8) > 1.04 * truth(16)
    assert blocked.slope == pytest.approx(80e-6 + 0.4e-3 / 16, rel=0.05)
    draft = LinearCost(0.2e-3, 7e-6)

    def tokens_per_second(k: int, alpha: float) -> float:  # the batch's, on the true costs
        return 8 * (1 - alpha ** (k + 1)) / (1 - alpha) / (truth(8 * (k + 1)) + k * draft(8))

    for accepted in (1, 2, 3):  # of 4 drafts, every step
        depth = AdaptiveDepth(4, True, blocked, draft)
        seqs = [seq_(f"s{i}") for i in range(8)]
        for s in seqs:
            for _ in range(20):
                depth.record(s.req_id, 4, accepted)
        alpha = depth.alpha("s0")
        best = max(range(5), key=lambda k: tokens_per_second(k, alpha))
        assert best == 1 and depth.plan(seqs, [100] * 8, fused=True) == [best] * 8, alpha


def test_blocked_cost_without_blocks_is_the_line():
    """Where no pass is in blocks (a batch of one, no AMX) the blocked cost fits what the cost
    without blocks fits."""
    blocked = BatchCost(5e-3, 5e-4, blocks=lambda n: 0, block_seconds=0.4e-3)
    line = BatchCost(5e-3, 5e-4)
    for n, t in ((1, 1e-3), (5, 1.4e-3), (3, 1.2e-3)) * 10:
        blocked.observe(n, t)
        line.observe(n, t)
    assert blocked.b == pytest.approx(line.b) and blocked(4) == pytest.approx(line(4))
    assert line.b == pytest.approx(0.1e-3, rel=0.05) and line(4) == pytest.approx(1.3e-3, rel=0.05)


def test_linear_cost_learns_a_line():
    cost = LinearCost(1.0, 1.0)
    for _ in range(200):
        for n in (1, 8, 32):
            cost.observe(n, 0.01 + 0.002 * n)
    assert cost.a == pytest.approx(0.01, rel=0.05) and cost.b == pytest.approx(0.002, rel=0.05)


def test_linear_cost_observes_repeated_passes_in_one_call():
    """`observe(n, t, count=c)` fits as c calls of `observe(n, t)` do."""
    one_by_one, at_once = LinearCost(1e-3, 1e-4), LinearCost(1e-3, 1e-4)
    for n, t, c in [(1, 2e-4, 4), (8, 9e-4, 3), (1, 2.5e-4, 1), (32, 3e-3, 2)] * 5:
        for _ in range(c):
            one_by_one.observe(n, t)
        at_once.observe(n, t, count=c)
        assert (at_once.a, at_once.b) == pytest.approx((one_by_one.a, one_by_one.b), rel=1e-9)


def test_linear_cost_is_not_moved_by_one_stall_but_follows_a_real_change():
    """A stalled pass counts as at most CLIP times the prediction: one 400 ms verification among
    5 ms ones barely moves the line (unclipped it would multiply it by five, and a draft line
    moved so makes plain decoding look cheaper for good: nothing drafts to correct it)."""
    cost = LinearCost(0.005, 0.0005)
    for _ in range(100):
        for n in (1, 5):
            cost.observe(n, 0.003 + 0.0004 * n)
    before = cost(1), cost(5)
    cost.observe(5, 0.4)  # counts as 15 ms: +11% at n = 5 (unclipped, 5 ms would become 28)
    assert cost(1) == pytest.approx(before[0], rel=0.05) and cost(5) == pytest.approx(before[1], rel=0.15)
    for _ in range(100):  # the passes really got dearer: twice the cost
        for n in (1, 5):
            cost.observe(n, 2 * (0.003 + 0.0004 * n))
    assert cost.a == pytest.approx(0.006, rel=0.05) and cost.b == pytest.approx(0.0008, rel=0.05)


def test_the_engine_prices_row_blocks_where_its_projections_have_them(checkpoint):
    """bfloat16 panels on a CPU with AMX (the demo target): the target's cost counts 16-row
    blocks from the fewest rows that take the tile unit, at a block's measured seconds; a
    float32 checkpoint's panels (the tiny test model's) have none, and the cost is a line."""
    from pathlib import Path

    from pdserve.engine import LLM
    from pdserve.kernels import native

    tiny = LLM(checkpoint("llama"), speculative_method="ngram", num_speculative_tokens=2)
    assert tiny.engine.runner.row_blocks() is None
    assert tiny.engine.speculator.depth.target_cost.c == 0
    if not (native.load() and torch.ops.pdserve.linear_tile_rows(16)):
        pytest.skip("no AMX tile path here: bfloat16 panels take the vector loops at every row count")
    demo = LLM(str(Path(__file__).resolve().parents[2] / "models" / "demo"), speculative_method="ngram",
               num_speculative_tokens=2)
    blocks, seconds = demo.engine.runner.row_blocks()
    fewest = next(m for m in range(1, 65) if torch.ops.pdserve.linear_tile_rows(m))
    assert [blocks(n) for n in (1, fewest - 1, fewest, 16, 17, 32, 33)] == [0, 0, 1, 1, 2, 2, 3]
    assert seconds > 0
    cost = demo.engine.speculator.depth.target_cost
    assert isinstance(cost, BatchCost) and cost.c > 0  # its own timing, at the engine's start
    assert cost(17) - cost(16) > cost(16) - cost(15)  # a new block


def test_the_target_costs_slope_stays_where_steps_stop_varying():
    """A batch of one that plain-decodes a burst and then drafts four a step for thousands of
    steps: its steps' spread in n decays towards the rounding error of the sums, and the slope
    keeps what the burst measured instead of following that error."""
    truth = lambda n: 1e-3 + 0.1e-3 * n  # noqa: E731
    cost = target_line()
    for _ in range(20):
        for n in (1, 5):
            cost.observe(n, truth(n))
    for i in range(5000):
        cost.observe(5, truth(5) * (1 + 1e-3 * ((i * 7919) % 13 - 6)))  # a little noise, one n
    assert cost.slope == pytest.approx(0.1e-3, rel=0.05)
    assert cost(1) == pytest.approx(truth(1), rel=0.05) and cost(5) == pytest.approx(truth(5), rel=0.01)

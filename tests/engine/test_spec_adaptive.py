"""Adaptive depth, fed by hand (no wall clock in a test): the depth model (`depth.py`: one depth
for the batch, trimmed per sequence), its cost lines and what the speculator feeds them. The gate
(which mode is cheaper) is in test_spec_gate.py; how the engine follows both, test_spec_gate_in_engine.py."""
from __future__ import annotations

import random

import time

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.depth import AdaptiveDepth, BatchCost, LinearCost, target_line
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.speculator import Speculator, StepShape


# ---- the depth model ------------------------------------------------------------------------
def make_depth(max_k=4, a_t=0.05, b_t=0.001, a_d=0.002, b_d=0.0002):
    t, d = LinearCost(a_t, b_t), LinearCost(a_d, b_d)
    return AdaptiveDepth(max_k, True, t, d)


def seq_(req_id="r"):
    return Sequence(req_id, [1, 2, 3], SamplingParams(), seed=0)


def reference_plan(depth: AdaptiveDepth, seqs: list[Sequence], rooms: list[int], fused: bool = False) -> list[int]:
    """`AdaptiveDepth.plan` as its docstring states it, pass by pass through `step_cost`, without
    the tables or the drift (the plan's tabled form must pick the same depths). fused, in a batch:
    every pass over every sequence, a position's marginal cost its verification's, and at least
    one draft for a sequence with room."""
    tops = [max(0, min(depth.max_k, r)) for r in rooms]
    alphas = [depth.alpha(s.req_id, not s.params.is_greedy) for s in seqs]
    fused = fused and len(seqs) > 1

    def rate(ks):
        expected = sum(k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a) for a, k in zip(alphas, ks))
        return expected / max(depth.step_cost(ks, fused), 1e-9)

    measured = depth.draft_cost is not None and not depth.draft_cost.is_guess
    slope = depth.target_cost.slope + (depth.draft_cost.b if measured and not fused else 0.0)
    best_ks, best = [0] * len(seqs), 0.0
    for k in range(max(tops, default=0) + 1):
        ks = [min(k, t) for t in tops]
        if k:
            worth = slope * rate(ks)
            ks = [next((j for j in range(1, kk + 1) if a ** j < worth), kk + 1) - 1 for a, kk in zip(alphas, ks)]
            if fused:
                ks = [max(j, min(1, t)) for j, t in zip(ks, (min(k, t) for t in tops))]
        if (r := rate(ks)) > best:
            best_ks, best = ks, r
    return best_ks


def test_plan_picks_what_the_reference_plan_picks():
    rng = __import__("random").Random(5)
    picked = set()
    for case in range(400):
        depth = make_depth(max_k=rng.randint(1, 8), a_t=rng.uniform(1e-4, 1e-2), b_t=rng.uniform(1e-6, 1e-3),
                           a_d=rng.uniform(1e-5, 5e-3), b_d=rng.uniform(0, 1e-4))
        if case % 3 == 0:
            depth.draft_cost.is_guess = True  # passes counted free
        seqs = [seq_(f"r{i}") for i in range(rng.randint(1, 40))]
        for s in seqs:
            for _ in range(rng.randint(0, 6)):
                k = rng.randint(1, 4)
                depth.record(s.req_id, k, rng.choice([k, rng.randint(0, k)]))
        rooms = [rng.randint(0, 10) for _ in seqs]
        fused = case % 2 == 1
        expected = reference_plan(depth, seqs, rooms, fused)
        assert depth.plan(seqs, rooms, fused) == expected, case
        picked.add(max(expected, default=0))
    assert len(picked) >= 4  # the cases reach several depths, not just plain decoding


def test_depth_follows_acceptance():
    depth = make_depth(a_d=0.02)  # a draft step costs 40% of a target step
    good, bad = seq_("good"), seq_("bad")
    for _ in range(20):
        depth.record("good", 4, 4)
        depth.record("bad", 4, 0)
    assert depth.plan([good], [10]) == [4]
    assert depth.plan([bad], [10]) == [0]
    assert depth.plan([good], [2]) == [2]  # never past the room left
    # together: the draft's passes are paid for the good one, so the bad one verifies at most
    # the position still worth its marginal cost (α ≈ 0.2: one)
    k_good, k_bad = depth.plan([good, bad], [10, 10])
    assert k_good >= 3 and k_bad <= 1
    # fused: the draft's passes run the bad one to the deepest anyway, and a sequence without a
    # draft would take the whole step off the fused path: it keeps one
    k_good, k_bad = depth.plan([good, bad], [10, 10], fused=True)
    assert k_good >= 2 and k_bad == 1
    assert depth.plan([bad], [10], fused=True) == [0]  # alone, depth 0 is a plain step


def test_depth_is_chosen_for_the_batch():
    """Sequences alike get one depth: the passes' fixed cost is shared, so a batch of mixed
    depths pays for the deepest draft chain and the widest verification at once."""
    depth = make_depth(a_t=0.02, b_t=0.0005, a_d=0.004, b_d=0.0001)
    seqs = [seq_(f"r{i}") for i in range(8)]
    for i in range(8):
        for _ in range(20):
            depth.record(f"r{i}", 4, 2 + i % 2)  # α about 0.7 to 0.8
    ks = depth.plan(seqs, [10] * 8)
    assert len(set(ks)) == 1 and ks[0] >= 1
    assert depth.plan(seqs, [1] + [10] * 7)[0] == 1  # the room left still caps one sequence


def test_depth_drops_to_zero_when_verification_is_not_free():
    depth = make_depth(a_t=0.001, b_t=0.01)  # compute-bound target: cost grows with tokens verified
    seqs = [seq_(f"r{i}") for i in range(32)]
    for _ in range(20):
        for s in seqs:
            depth.record(s.req_id, 4, 3)
    assert depth.plan(seqs, [10] * 32) == [0] * 32
    cheap = make_depth(a_t=0.05, b_t=0.0001)  # memory-bound target: verifying k + 1 is nearly free
    for _ in range(20):
        cheap.record("r0", 4, 3)
    assert cheap.plan(seqs[:1], [10])[0] >= 3


def test_depth_drifts_back_so_a_sequence_retries():
    depth = make_depth(a_d=0.02)
    s = seq_()
    for _ in range(10):
        depth.record("r", 4, 0)
    assert depth.plan([s], [10]) == [0]
    ks = [depth.plan([s], [10])[0] for _ in range(200)]
    assert ks[0] == 0 and max(ks) >= 1  # it speculates again once its estimate drifts up


def test_an_untried_sequence_drafts_once_and_shows_its_acceptance():
    """Costs where PRIOR acceptance is not worth a draft token but the pair's real 0.97 is: a
    sequence started at PRIOR would never draft, so never show 0.97."""
    depth = make_depth(a_t=0.01, b_t=0.002, a_d=0.008, b_d=0.0001)
    s = seq_()
    assert depth.plan([s], [10])[0] >= 1  # untried: it drafts
    for _ in range(20):
        depth.record("r", 4, 4)
    assert depth.plan([s], [10])[0] >= 3
    fresh = make_depth(a_t=0.01, b_t=0.002, a_d=0.008, b_d=0.0001)
    fresh.record("other", 4, 0)
    assert fresh.alpha("other") < fresh.PRIOR < fresh.alpha("never-planned") == 1.0


def test_an_untried_sequence_starts_from_its_kinds_acceptance():
    """Once a kind (greedy or sampled) has a record, a new sequence of that kind is planned at the
    kind's acceptance, not at 1: a sampled batch the proposer fails (n-gram at temperature 1,
    about 0.01) no longer opens with every new sequence at the full depth. The other kind is
    untouched, and a kind with too short a record still starts at 1."""
    depth = make_depth(a_d=0.02)
    sampled = Sequence("new-sampled", [1, 2, 3], SamplingParams(temperature=1.0), seed=0)
    greedy = Sequence("new-greedy", [1, 2, 3], SamplingParams(temperature=0), seed=0)
    depth.record("old-sampled", 4, 0, sampled=True)
    assert depth.alpha("new-sampled", sampled=True) == 1.0  # one record is not enough
    for i in range(20):
        depth.record(f"old-{i}", 4, 0, sampled=True)
    assert depth.alpha("new-sampled", sampled=True) == 0.0
    assert depth.plan([sampled], [10]) == [0]
    assert depth.alpha("new-greedy") == 1.0 and depth.plan([greedy], [10]) == [4]
    for i in range(20):
        depth.record(f"old-greedy-{i}", 4, 3)  # greedy: three of four accepted, about 0.75
    assert 0.7 < depth.alpha("another-greedy") < 0.8
    assert depth.plan([Sequence("another-greedy", [1, 2, 3], SamplingParams(temperature=0), seed=0)], [10])[0] >= 1


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


def test_default_options_draft_from_the_first_request(checkpoint):
    """README's options (adaptive depth, no capture) with a short prompt: the first request
    drafts. With the draft's guessed cost taken as a measurement it did not, on any request."""
    from pdserve.engine import LLM

    target = checkpoint("llama")
    llm = LLM(target, draft_model=target, num_speculative_tokens=4)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    st = llm.engine.speculator.stats
    assert st.num_drafts >= 1 and st.num_accepted_tokens >= 1
    assert not llm.engine.speculator.depth.draft_cost.is_guess  # its passes were measured


def _tile_blocks(n: int) -> int:  # the demo target's projections on a CPU with AMX: 16-row blocks from 7 rows
    return -(-n // 16) if n >= 7 else 0


def test_blocked_cost_prices_a_block_the_line_smooths_over():
    """Steps of a batch of 8 seen at 8 rows (plain) and 32 (three drafts each), costing 80 µs a
    row and 0.4 ms a 16-row block: `BatchCost`, told the block's seconds, predicts 16 and 24
    rows, where a line fit on the same steps reads 16 rows 5% dearer; and its plan at acceptance
    0.53, 0.67 and 0.75 is one draft a sequence, the fastest depth on those costs (16 rows, in
    plain decoding's one block) at each."""
    truth = lambda n: 1e-3 + 80e-6 * n + 0.4e-3 * _tile_blocks(n)  # noqa: E731
    blocked = BatchCost(5e-3, 5e-4, blocks=_tile_blocks, block_seconds=0.4e-3)
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


def test_plan_with_blocks_picks_what_the_reference_plan_picks():
    """The tabled plan against `reference_plan` with a blocked target cost, over random batches."""
    rng = random.Random(5)
    picked = set()
    for _ in range(300):
        target = BatchCost(5e-3, 5e-4, blocks=_tile_blocks, block_seconds=rng.uniform(0, 1e-3))
        depth = AdaptiveDepth(rng.randint(1, 5), True, target, LinearCost(rng.uniform(0, 5e-4), rng.uniform(0, 2e-5)))
        seqs = [seq_(f"q{i}") for i in range(rng.randint(2, 12))]
        a, b = rng.uniform(0, 3e-3), rng.uniform(0, 1e-4)
        for n in (len(seqs), 3 * len(seqs)):  # measured: a + b·n at this batch size
            target.observe(n, a + b * n + target.c * target.blocks(n), seqs=len(seqs))
        for s in seqs:
            for _ in range(rng.randint(0, 6)):
                k = rng.randint(1, 4)
                depth.record(s.req_id, k, rng.randint(0, k))
        rooms = [rng.randint(0, 6) for _ in seqs]
        fused = rng.random() < 0.5
        expected = reference_plan(depth, seqs, rooms, fused)
        assert depth.plan(seqs, rooms, fused) == expected
        picked.add(max(expected))
    assert {1, 2} <= picked  # blocks make shallow plans win too


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


# ---- what the depth model is fed ---------------------------------------------------------------
class _SlowNgram(NgramProposer):
    """An n-gram proposer whose proposals take at least 20 ms, as a draft model's passes take time."""

    def propose(self, seqs, ks):
        time.sleep(0.02)
        return super().propose(seqs, ks)


def test_the_target_cost_is_the_steps_wall_time_less_the_proposal():
    """The depth model prices a step by its target side: the step's wall time less the draft's
    proposal, so the verification's sampling and the bookkeeping count, not the forward alone
    (which left them out and made deep verification look cheaper than it is)."""
    spec = Speculator(NgramProposer(1, 3), AdaptiveDepth(4, True, LinearCost(5e-3, 5e-4), None), verifier=None,
                      catches_up=False)
    decode = StepShape(is_decode_only=True)
    spec.observe_step(StepShape(is_decode_only=False), 0.5, [], target_pass=(100, 0.4))  # a prompt: not priced
    assert (spec.depth.target_cost.a, spec.depth.target_cost.b) == (5e-3, 5e-4)
    for _ in range(300):
        for n in (1, 9):  # the forward is 1 ms whatever n; the step 10 ms + 2 ms a token
            spec.observe_step(decode, 0.010 + 0.002 * n, [], target_pass=(n, 0.001))
    cost = spec.depth.target_cost
    assert cost.a == pytest.approx(0.010, rel=0.05) and cost.b == pytest.approx(0.002, rel=0.05)
    slow = Speculator(_SlowNgram(1, 3), AdaptiveDepth(4, True, target_line(), None), verifier=None,
                      catches_up=False)
    slow.propose([seq_()], [2])
    assert slow._propose_seconds >= 0.02
    slow.observe_step(decode, 0.021, [], target_pass=(3, 0.004))  # never less than the forward itself
    assert slow._propose_seconds == 0.0
    assert slow.depth.target_cost(3) == pytest.approx(0.004)  # its first step: 4 ms, not 1 ms


def test_the_single_sequence_plan_is_the_batch_plans():
    """`_best_one` (batch 1, in scalars) picks what `_best_batch` picks for a batch of one, over
    random acceptances, depth limits and cost lines (a draft's measured, guessed, or none)."""
    rng = random.Random(1)
    for _ in range(3000):
        draft = None if rng.random() < 0.2 else LinearCost(rng.uniform(0, 2e-3), rng.uniform(0, 1e-4),
                                                             guess=rng.random() < 0.2)
        depth = AdaptiveDepth(rng.randint(1, 6), True, LinearCost(rng.uniform(0, 5e-3), rng.uniform(0, 5e-4)), draft)
        alpha, top = rng.choice([1.0, 0.0, rng.random(), rng.uniform(0.9, 1.0)]), rng.randint(0, 6)
        assert depth._best_one(alpha, top) == depth._best_batch([alpha], [top])[0], (alpha, top)



def test_a_single_sequences_kept_plan_follows_its_acceptance_and_the_cost_lines():
    """A batch of one's depth is kept per acceptance step while the predicted costs stay within
    LINES_MOVED (`_best_one_kept`): kept, it is what `_best_one` picks for some acceptance in
    the same step; once a line moves further, it is picked again: at α = 0.9 the full depth wins
    while the draft is cheap; its passes then get 100 times dearer, and the kept depth gives
    way."""
    depth = AdaptiveDepth(4, True, LinearCost(1e-3, 1e-5), LinearCost(2e-5, 1e-6))
    rng = random.Random(2)
    for _ in range(500):
        alpha, top = rng.random(), rng.randint(0, 4)
        kept = depth._best_one_kept(alpha, top)
        step = int(alpha * depth.ALPHA_STEPS)  # picked at some acceptance in the same step: deeper the higher
        low, high = step / depth.ALPHA_STEPS, (step + 1) / depth.ALPHA_STEPS - 1e-12
        assert depth._best_one(low, top) <= kept <= depth._best_one(high, top), (alpha, top)
    assert depth._best_one_kept(0.9, 4) == 4
    depth.draft_cost = LinearCost(2e-3, 1e-6)  # a pass now costs twice a verification
    assert depth._best_one(0.9, 4) < 4 and depth._best_one_kept(0.9, 4) == depth._best_one(0.9, 4)


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


def test_a_plan_skipped_as_all_plain_is_what_the_full_plan_picks():
    """`_all_plain` skips the search over depths only where the search would pick plain decoding:
    over random costs (a line or per-batch-size with row blocks, fused or not) and acceptances
    near its bound, whenever it says plain the full search (`_best`) plans no draft, and it says
    so in a good share of the cases (acceptances below the bound)."""
    rng = random.Random(11)
    skipped = 0
    for i in range(400):
        num_seqs = rng.randint(1, 12)
        if i % 2:
            target = BatchCost(5e-3, 5e-4, blocks=_tile_blocks, block_seconds=rng.uniform(0, 1e-3))
            a, b = rng.uniform(0, 3e-3), rng.uniform(1e-6, 1e-4)
            for n in (num_seqs, 3 * num_seqs):
                target.observe(n, a + b * n + target.c * target.blocks(n), seqs=num_seqs)
        else:
            target = LinearCost(rng.uniform(0, 3e-3), rng.uniform(1e-6, 1e-4))
        draft = LinearCost(rng.uniform(0, 5e-4), rng.uniform(0, 2e-5)) if rng.random() < 0.7 else None
        depth = AdaptiveDepth(rng.randint(1, 5), True, target, draft)
        bound = target.least_slope * num_seqs / target(num_seqs, num_seqs)
        alphas = [min(1.0, bound * rng.uniform(0.2, 1.3)) for _ in range(num_seqs)]
        tops = [rng.randint(0, 5) for _ in range(num_seqs)]
        fused = rng.random() < 0.5
        if depth._all_plain(alphas):
            skipped += 1
            assert depth._best(alphas, tops, fused) == [0] * num_seqs
    assert skipped > 50

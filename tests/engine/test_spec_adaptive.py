"""Adaptive speculation's own logic, fed by hand (no wall clock in a test): the depth model
(`depth.py`: one depth for the batch, trimmed per sequence) and the gate (`gate.py`: which mode
is cheaper, per regime, and when to measure the other again). How the engine follows them is in
test_spec_decode.py."""
from __future__ import annotations

import copy
import math
import time

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.depth import AdaptiveDepth, LinearCost, target_line
from pdserve.engine.spec_decode.gate import SpeculationGate as Gate
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.speculator import Speculator, StepShape


# ---- the depth model ------------------------------------------------------------------------
def make_depth(max_k=4, a_t=0.05, b_t=0.001, a_d=0.002, b_d=0.0002):
    t, d = LinearCost(a_t, b_t), LinearCost(a_d, b_d)
    return AdaptiveDepth(max_k, True, t, d)


def seq_(req_id="r"):
    return Sequence(req_id, [1, 2, 3], SamplingParams(), seed=0)


def reference_plan(depth: AdaptiveDepth, seqs: list[Sequence], rooms: list[int]) -> list[int]:
    """`AdaptiveDepth.plan` as its docstring states it, pass by pass through `step_cost`, without
    the tables or the drift (the plan's tabled form must pick the same depths)."""
    tops = [max(0, min(depth.max_k, r)) for r in rooms]
    alphas = [depth.alpha(s.req_id, not s.params.is_greedy) for s in seqs]

    def rate(ks):
        expected = sum(k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a) for a, k in zip(alphas, ks))
        return expected / max(depth.step_cost(ks), 1e-9)

    measured = depth.draft_cost is not None and not depth.draft_cost.is_guess
    slope = depth.target_cost.b + (depth.draft_cost.b if measured else 0.0)
    best_ks, best = [0] * len(seqs), 0.0
    for k in range(max(tops, default=0) + 1):
        ks = [min(k, t) for t in tops]
        if k:
            worth = slope * rate(ks)
            ks = [next((j for j in range(1, kk + 1) if a ** j < worth), kk + 1) - 1 for a, kk in zip(alphas, ks)]
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
        expected = reference_plan(depth, seqs, rooms)
        assert depth.plan(seqs, rooms) == expected, case
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


def test_the_target_line_is_the_measured_steps_once_they_span_two_sizes():
    """The engine's target line (`target_line`) is its prior until steps of two sizes are seen,
    then almost only the measured steps. Kept at full weight, the prior's point at 64 tokens set
    the slope after a short prompt: a 9-token prefill and forty 0.4 ms decode steps read as
    0.57 ms a token, verification looked as dear as plain steps, and depth stayed at 0 for good."""
    line, as_prior = target_line(), LinearCost(5e-3, 5e-4)
    for cost in (line, as_prior):
        cost.observe(9, 0.0021)
    assert line.is_guess  # one size so far: the prior keeps its weight
    for _ in range(40):
        for cost in (line, as_prior):
            cost.observe(1, 0.0004)
    assert not line.is_guess
    assert line(1) == pytest.approx(0.0004, rel=0.1) and line(5) < 0.0015
    assert as_prior.b > 0.0005 and as_prior(5) > 0.0025  # the prior's slope
    draft = LinearCost(0.0, 8e-5)  # measured: 0.08 ms a pass
    seq = seq_("a")
    plans = []
    for target in (line, as_prior):
        depth = AdaptiveDepth(4, True, target, draft)
        depth.record(seq.req_id, 4, 4)  # drafts accepted: alpha near 0.9
        plans.append(depth.plan([seq], [10]))
    assert plans[0][0] >= 1 and plans[1] == [0]  # drafting, against never again


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


# ---- the gate ----------------------------------------------------------------------------------
def _bursts(decisions: list[bool], mode: bool) -> list[tuple[int, int]]:
    """(start index, length) of each run of `mode` in decisions."""
    runs, start = [], None
    for i, d in enumerate(decisions + [not mode]):
        if d == mode and start is None:
            start = i
        elif d != mode and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def test_gate_measures_both_modes_then_keeps_the_cheaper_and_explores_less_often():
    gate = Gate()
    first = [gate.allow(32) for _ in range(2 * Gate.BURST)]
    assert first == [True] * Gate.BURST + [False] * Gate.BURST  # a burst of each mode to measure them
    for _ in range(Gate.BURST):
        gate.observe(32, True, seconds=0.30, num_tokens=40)  # 7.5 ms per token
        gate.observe(32, False, seconds=0.10, num_tokens=32)  # 3.1 ms per token: plain wins here
    decisions = [gate.allow(32) for _ in range(4 * Gate.MAX_PERIOD)]
    bursts = _bursts(decisions, True)
    assert all(length == Gate.BURST for _, length in bursts)  # only exploring bursts speculate
    gaps = [b[0] - a[0] - Gate.BURST for a, b in zip(bursts, bursts[1:])]
    assert bursts[0][0] == Gate.PERIOD
    # each burst that leaves plain winning doubles the wait for the next, up to MAX_PERIOD
    assert gaps[:4] == [2 * Gate.PERIOD, 4 * Gate.PERIOD, 8 * Gate.PERIOD, 16 * Gate.PERIOD]
    assert max(gaps) == Gate.MAX_PERIOD and gaps[-1] == Gate.MAX_PERIOD

    # the winner changes: speculation now measures cheaper, is measured again at once (a burst),
    # and wins; the wait starts again at PERIOD
    for _ in range(30):
        gate.observe(32, True, seconds=0.05, num_tokens=40)
    after = [gate.allow(32) for _ in range(3 * Gate.PERIOD)]
    assert after[0] is True
    plain_bursts = _bursts(after, False)
    assert plain_bursts and plain_bursts[0] == (Gate.BURST + Gate.PERIOD, Gate.BURST)

    # batch 1 keeps its own record
    for _ in range(2 * Gate.BURST):
        gate.allow(1)
    gate.observe(1, True, seconds=0.02, num_tokens=4)  # 5 ms per token
    gate.observe(1, False, seconds=0.01, num_tokens=1)  # 10 ms per token
    assert [gate.allow(1) for _ in range(Gate.PERIOD + Gate.BURST)].count(False) == Gate.BURST


def test_a_drifting_winner_measures_the_other_mode_again_before_switching():
    """When the running mode's cost drifts above the other mode's last figure (contexts grow
    over a run), the other mode is measured again at once, not switched to on an old figure: if
    the burst shows it dearer after all, the running mode stays, and its wait doubles."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(8, True)
    for _ in range(Gate.BURST):
        gate.observe(8, True, seconds=0.0060, num_tokens=10, sampled=True)  # 0.60 ms per token
        gate.observe(8, False, seconds=0.0040, num_tokens=8, sampled=True)  # 0.50 ms: plain wins
    assert [gate.allow(8, True) for _ in range(10)] == [False] * 10
    for _ in range(20):  # longer contexts: plain steps now cost 0.65 ms per token
        gate.observe(8, False, seconds=0.0052, num_tokens=8, sampled=True)
    burst = [gate.allow(8, True) for _ in range(Gate.BURST)]
    assert burst == [True] * Gate.BURST  # speculation is measured again, not switched to
    for _ in range(Gate.BURST):  # and at these contexts it costs 0.80 ms per token
        gate.observe(8, True, seconds=0.0080, num_tokens=10, sampled=True)
    assert [gate.allow(8, True) for _ in range(2 * Gate.PERIOD)] == [False] * (2 * Gate.PERIOD)


def test_unsettled_steps_keep_the_verdict_and_do_not_move_the_schedule():
    """Steps right after a prefill (unsettled: the engine does not measure them) get the current
    verdict, and no burst is spent on them: the measuring bursts wait for settled steps."""
    gate = Gate()
    assert [gate.allow(8, True, settled=False) for _ in range(20)] == [True] * 20  # nothing measured yet
    first = [gate.allow(8, True) for _ in range(2 * Gate.BURST)]
    assert first == [True] * Gate.BURST + [False] * Gate.BURST  # the bursts start at the first settled step
    for _ in range(Gate.BURST):
        gate.observe(8, True, seconds=0.010, num_tokens=12, sampled=True)
        gate.observe(8, False, seconds=0.004, num_tokens=8, sampled=True)  # plain wins
    assert gate.allow(8, True) is False
    steps = gate._schedules[gate.regime(8, True)].steps
    assert [gate.allow(8, True, settled=False) for _ in range(3 * Gate.PERIOD)] == [False] * (3 * Gate.PERIOD)
    assert gate._schedules[gate.regime(8, True)].steps == steps
    # the exploring burst comes PERIOD settled steps after the decision, however many unsettled ones came between
    settled = [gate.allow(8, True) for _ in range(Gate.PERIOD + Gate.BURST)]
    assert _bursts(settled, True) == [(Gate.PERIOD - 1, Gate.BURST)]


def test_gate_keeps_greedy_and_sampled_batches_apart_and_renews_for_new_requests():
    gate = Gate()
    for sampled in (False, True):
        for _ in range(2 * Gate.BURST):
            gate.allow(1, sampled)
    for _ in range(10):
        gate.observe(1, True, seconds=0.010, num_tokens=5, sampled=False)  # greedy: 2 ms per token
        gate.observe(1, False, seconds=0.003, num_tokens=1, sampled=False)  # 3 ms
        gate.observe(1, True, seconds=0.010, num_tokens=2, sampled=True)  # sampled: 5 ms per token
        gate.observe(1, False, seconds=0.003, num_tokens=1, sampled=True)  # 3 ms
    assert [gate.allow(1, False) for _ in range(Gate.PERIOD)].count(True) == Gate.PERIOD
    assert [gate.allow(1, True) for _ in range(Gate.PERIOD)].count(True) == 0

    # sampled batches stay plain, and the waits between exploring bursts grow long
    for _ in range(3 * Gate.MAX_PERIOD):
        gate.allow(1, True)
    in_burst = False
    while (speculates := gate.allow(1, True)) or not in_burst:  # to the end of an exploring burst
        in_burst = in_burst or speculates
    far = copy.deepcopy(gate)
    far.renew(1, True)  # speculation lost by 67%: new requests do not bring its burst forward
    assert True not in [far.allow(1, True) for _ in range(Gate.PERIOD + 1)]
    for _ in range(30):  # now it loses by 10% only
        gate.observe(1, True, seconds=0.0066, num_tokens=2, sampled=True)
    gate.allow(1, True)
    renewed = copy.deepcopy(gate)
    renewed.renew(1, True)  # most requests are new: measured again within PERIOD
    assert True not in [gate.allow(1, True) for _ in range(Gate.PERIOD + 1)]
    assert True in [renewed.allow(1, True) for _ in range(Gate.PERIOD + 1)]


def test_gate_is_not_turned_by_one_stalled_step_but_follows_a_real_change():
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(1)
    for _ in range(10):
        gate.observe(1, True, seconds=0.015, num_tokens=5)  # 3 ms per token
        gate.observe(1, False, seconds=0.009, num_tokens=1)  # 9 ms per token
    gate.observe(1, True, seconds=2.0, num_tokens=5)  # the host stalled for two seconds
    assert gate.seconds_per_token(1, True) < gate.seconds_per_token(1, False)
    assert all(gate.allow(1) for _ in range(Gate.PERIOD - 1))
    for _ in range(25):  # acceptance collapsed: speculating now costs 15 ms per token
        gate.observe(1, True, seconds=0.015, num_tokens=1)
    assert gate.seconds_per_token(1, True) > gate.seconds_per_token(1, False)


def test_a_stall_in_a_modes_first_step_does_not_decide_the_first_verdict():
    """The first step of a mode has no figure to be clipped by; the second clips it. Here the
    first speculative step stalled (a collection pass, say) and speculation still wins."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(1)
    gate.observe(1, True, seconds=0.400, num_tokens=5)  # the stall: 80 ms per token
    for _ in range(Gate.BURST - 1):
        gate.observe(1, True, seconds=0.015, num_tokens=5)  # 3 ms per token
    for _ in range(Gate.BURST):
        gate.observe(1, False, seconds=0.009, num_tokens=1)  # 9 ms per token
    assert gate.seconds_per_token(1, True) < gate.seconds_per_token(1, False)
    assert all(gate.allow(1) for _ in range(Gate.PERIOD - 1))
    # a first step that was only a little dearer than the second is kept as it was
    fair = Gate()
    fair.observe(1, True, seconds=0.020, num_tokens=5)
    fair.observe(1, True, seconds=0.015, num_tokens=5)
    assert fair.seconds_per_token(1, True) == pytest.approx((0.020 * Gate.DECAY + 0.015) / (5 * Gate.DECAY + 5))


def test_an_expensive_switch_to_speculation_spaces_the_bursts_and_must_be_repaid():
    """A draft that must catch up before speculating again makes each switch cost seconds: while
    plain decoding wins, bursts of speculation come only as often as keeps that under
    EXPLORE_SHARE of the plain time between, and a speculation only slightly cheaper than plain
    decoding (10%) does not win the switch, where without the switch's cost it would."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(32, True)
    for _ in range(Gate.BURST):
        gate.observe(32, True, seconds=0.040, num_tokens=64, sampled=True)  # 0.625 ms per token
        gate.observe(32, False, seconds=0.016, num_tokens=32, sampled=True)  # 0.5 ms per token: plain wins
    cheap = copy.deepcopy(gate)
    gate.observe_switch(32, 0.24, sampled=True)  # a quarter second to catch the draft up
    plain_step = 0.016
    want = math.ceil(0.24 / (Gate.EXPLORE_SHARE * plain_step))  # 750 plain steps pay for one switch
    decisions = [gate.allow(32, True) for _ in range(3 * want)]
    bursts = _bursts(decisions, True)
    assert bursts[0][0] >= want - 1 and all(b[0] - a[0] >= want for a, b in zip(bursts, bursts[1:]))
    # without a switch cost (an n-gram proposer), the first burst comes after PERIOD
    assert _bursts([cheap.allow(32, True) for _ in range(2 * Gate.PERIOD)], True)[0][0] == Gate.PERIOD

    # speculation now measures 10% cheaper than plain: not enough to repay 0.24 s within PERIOD steps
    for _ in range(40):
        gate.observe(32, True, seconds=0.0144, num_tokens=32, sampled=True)
        cheap.observe(32, True, seconds=0.0144, num_tokens=32, sampled=True)
    assert not any(gate.allow(32, True) for _ in range(Gate.PERIOD))
    assert all(cheap.allow(32, True) for _ in range(Gate.PERIOD))
    # and 40% cheaper is
    for _ in range(40):
        gate.observe(32, True, seconds=0.0096, num_tokens=32, sampled=True)
    assert all(gate.allow(32, True) for _ in range(Gate.PERIOD))


def test_a_burst_of_speculation_waits_for_new_requests_when_switching_costs():
    """While plain decoding wins and a switch costs a draft's catch-up, a burst of speculation
    that comes due waits until most of the batch is new (`renew`), when the draft has little to
    catch up on, and starts within FRESH steps of it; with no new requests, after one period more.
    Without a switch cost (an n-gram proposer) bursts keep the schedule."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(8, True)
    for _ in range(Gate.BURST):
        gate.observe(8, True, seconds=0.010, num_tokens=12, sampled=True)
        gate.observe(8, False, seconds=0.004, num_tokens=8, sampled=True)  # plain wins by 67%
    no_switch = copy.deepcopy(gate)
    gate.observe_switch(8, 0.002, sampled=True)  # cheap enough that the period stays PERIOD
    st = gate._schedules[gate.regime(8, True)]
    decisions = [gate.allow(8, True) for _ in range(Gate.PERIOD + 10)]
    assert not any(decisions) and st.due is not None  # due, waiting
    gate.renew(8, True)
    fresh = [gate.allow(8, True) for _ in range(Gate.FRESH + Gate.BURST)]
    assert fresh[:Gate.BURST] == [True] * Gate.BURST  # the burst starts at once
    for _ in range(Gate.BURST):
        gate.observe(8, True, seconds=0.010, num_tokens=12, sampled=True)  # and plain still wins
    period = st.period  # doubled: the burst left plain winning
    waited = [gate.allow(8, True) for _ in range(6 * Gate.PERIOD)]  # no new requests: the period, then one more
    start, length = _bursts(waited, True)[0]
    assert length == Gate.BURST and start + Gate.FRESH == 2 * period
    assert _bursts([no_switch.allow(8, True) for _ in range(2 * Gate.PERIOD)], True)[0][0] == Gate.PERIOD


def test_at_parity_the_running_mode_stays_and_is_not_measured_early():
    """Once decided, the verdict moves only on a margin: the other mode measuring cheaper by less
    than KEEP_MARGIN (the host's noise, at parity) neither switches the mode nor brings the other
    mode's burst forward; by more, it does both as before."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(8, True)
    for _ in range(Gate.BURST):
        gate.observe(8, True, seconds=0.0040, num_tokens=10, sampled=True)  # 0.40 ms per token: speculation wins
        gate.observe(8, False, seconds=0.0034, num_tokens=8, sampled=True)  # 0.425 ms per token
    assert gate.allow(8, True) is True
    for _ in range(30):  # speculation drifts to 0.44 ms per token: 3.5% dearer than plain's last figure
        gate.observe(8, True, seconds=0.0044, num_tokens=10, sampled=True)
    assert [gate.allow(8, True) for _ in range(Gate.PERIOD - 1)] == [True] * (Gate.PERIOD - 1)
    # the scheduled burst of plain decoding still comes, and at 0.42 ms (within the margin) does not win
    assert [gate.allow(8, True) for _ in range(Gate.BURST)] == [False] * Gate.BURST
    for _ in range(Gate.BURST):
        gate.observe(8, False, seconds=0.00336, num_tokens=8, sampled=True)
    assert [gate.allow(8, True) for _ in range(8)] == [True] * 8
    for _ in range(30):  # 0.60 ms per token: well past the margin, plain decoding is measured at once
        gate.observe(8, True, seconds=0.0060, num_tokens=10, sampled=True)
    assert [gate.allow(8, True) for _ in range(Gate.BURST)] == [False] * Gate.BURST
    for _ in range(Gate.BURST):
        gate.observe(8, False, seconds=0.00336, num_tokens=8, sampled=True)
    assert [gate.allow(8, True) for _ in range(8)] == [False] * 8  # and it wins


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
    for _ in range(300):
        for n in (1, 9):  # the forward is 1 ms whatever n; the step 10 ms + 2 ms a token
            spec.observe_step(decode, 0.010 + 0.002 * n, [], target_pass=(n, 0.001))
    cost = spec.depth.target_cost
    assert cost.a == pytest.approx(0.010, rel=0.05) and cost.b == pytest.approx(0.002, rel=0.05)
    slow = Speculator(_SlowNgram(1, 3), AdaptiveDepth(4, True, LinearCost(5e-3, 5e-4), None), verifier=None,
                      catches_up=False)
    slow.propose([seq_()], [2])
    assert slow._propose_seconds >= 0.02
    slow.observe_step(decode, 0.021, [], target_pass=(3, 0.004))  # never less than the forward itself
    assert slow._propose_seconds == 0.0
    assert slow.depth.target_cost(3) < LinearCost(5e-3, 5e-4)(3)  # it saw 4 ms, under the prior's 6.5 ms


def test_a_new_regime_starts_from_its_decided_neighbour():
    """A batch that drains from 32 to 31 (or fills from 31 to 32) keeps the verdict of the
    bucket next to it instead of spending a burst of each mode; it still measures the other
    mode itself after PERIOD steps. Far buckets and the other kind are not neighbours."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(32, sampled=True)
    for _ in range(Gate.BURST):
        gate.observe(32, True, seconds=0.30, num_tokens=40, sampled=True)
        gate.observe(32, False, seconds=0.10, num_tokens=32, sampled=True)
    assert gate.allow(32, sampled=True) is False  # plain wins at 32-63
    drained = []
    for _ in range(Gate.PERIOD + Gate.BURST):
        drained.append(gate.allow(31, sampled=True))
        gate.observe(31, drained[-1], seconds=0.10 if not drained[-1] else 0.30, num_tokens=31 if not drained[-1] else 40,
                     sampled=True)
    assert drained[:Gate.PERIOD - 1] == [False] * (Gate.PERIOD - 1)  # no opening burst of speculation
    assert True in drained[Gate.PERIOD - 1:]  # its own measurement of speculation, later
    assert gate.allow(31, sampled=True) is False
    assert [gate.allow(31) for _ in range(Gate.BURST)] == [True] * Gate.BURST  # greedy: a kind of its own
    assert [gate.allow(4, sampled=True) for _ in range(Gate.BURST)] == [True] * Gate.BURST  # 4-7: next to neither


def test_a_filling_batch_takes_the_verdict_of_the_batch_it_becomes():
    """Right after a prefill, while a batch of 32 is still being admitted (22 running, 10 more
    waiting), the step takes the verdict of the 32-sequence bucket, not of the 16–31 one the
    running sequences alone would name; once settled, the running batch names its bucket."""
    spec = Speculator(NgramProposer(1, 3), AdaptiveDepth(4, True, LinearCost(5e-3, 5e-4), None), verifier=None,
                      catches_up=False)
    gate = spec.gate
    for size, spec_seconds in ((32, 0.30), (22, 0.05)):  # plain wins at 32-63, speculation at 16-31
        for _ in range(2 * Gate.BURST):
            gate.allow(size, sampled=True)
        for _ in range(Gate.BURST):
            gate.observe(size, True, seconds=spec_seconds, num_tokens=40, sampled=True)
            gate.observe(size, False, seconds=0.10, num_tokens=size, sampled=True)
    assert gate.allow(32, sampled=True) is False and gate.allow(22, sampled=True) is True
    running = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=1.0), seed=i) for i in range(22)]
    spec.observe_step(StepShape(is_decode_only=False), 0.5, [], target_pass=(100, 0.4))  # a prefill: unsettled
    assert spec.allow(running, filling=10) is False
    assert spec.allow(running) is True  # nothing more to come: the running batch's own bucket
    for _ in range(Speculator.WARMUP_STEPS):
        spec.observe_step(StepShape(is_decode_only=True), 0.02, [], target_pass=(22, 0.01))
    assert spec.allow(running, filling=10) is True  # settled: measured as what runs

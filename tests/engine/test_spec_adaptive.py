"""Adaptive depth, fed by hand (no wall clock in a test): the depth model (`depth.py`: one depth
for the batch, trimmed per sequence) and what the speculator feeds it. Its cost lines are in
test_spec_costs.py; the gate (which mode is cheaper) in test_spec_gate.py; how the engine follows
both, test_spec_gate_in_engine.py."""
from __future__ import annotations

import dataclasses
import random

import time

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.costs import BatchCost, LinearCost, target_line
from pdserve.engine.spec_decode.depth import AdaptiveDepth
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.speculator import Speculator, StepShape

from depth_driving import seq_, tile_blocks


# ---- the depth model ------------------------------------------------------------------------
def make_depth(max_k=4, a_t=0.05, b_t=0.001, a_d=0.002, b_d=0.0002):
    t, d = LinearCost(a_t, b_t), LinearCost(a_d, b_d)
    return AdaptiveDepth(max_k, True, t, d)


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


def test_plan_with_blocks_picks_what_the_reference_plan_picks():
    """The tabled plan against `reference_plan` with a blocked target cost, over random batches."""
    rng = random.Random(5)
    picked = set()
    for _ in range(300):
        target = BatchCost(5e-3, 5e-4, blocks=tile_blocks, block_seconds=rng.uniform(0, 1e-3))
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
            target = BatchCost(5e-3, 5e-4, blocks=tile_blocks, block_seconds=rng.uniform(0, 1e-3))
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


def test_a_draft_line_walked_up_by_stalls_is_started_afresh():
    """The draft's line is fed only by its passes. Walked up by a run of stalls (each at most
    CLIP times the line), it made every plan plain, and plain plans fed it nothing. After
    REMEASURE_PLANS plans with no drafts and no pass, the plan starts the line afresh (a guess:
    its passes free until measured) and drafts. Where no depth pays even with the passes free
    (`_all_plain`), the line is left as it is."""
    periods = AdaptiveDepth.REMEASURE_PLANS
    draft = LinearCost(2e-3, 5e-5, guess=True)
    depth = AdaptiveDepth(4, True, LinearCost(0.002, 0.0001), draft)  # verifying 5 tokens nearly free
    s = seq_()
    for _ in range(20):
        draft.observe(1, 1e-4)  # the draft's passes: 0.1 ms
    assert depth.plan([s], [100]) == [4]
    while depth.plan([s], [100])[0]:  # the plan that drafts nothing is the period's first
        draft.observe(1, 1.0)  # a stall: counted at most CLIP times the line
    assert draft(1) > 1e-3 and not draft.is_guess
    ks = [depth.plan([s], [100])[0] for _ in range(periods)]
    assert ks[:-1] == [0] * (periods - 1) and ks[-1] >= 1 and draft.is_guess

    draft = LinearCost(2e-3, 5e-5, guess=True)  # a dear target row and a sequence that accepts nothing
    depth = AdaptiveDepth(4, True, LinearCost(1e-4, 0.01), draft)
    for _ in range(20):
        draft.observe(1, 1e-4)
        depth.record("r", 4, 0)
    for _ in range(3 * periods):
        assert depth.plan([s], [100]) == [0]
    assert not draft.is_guess


def test_the_engine_drafts_again_after_its_draft_line_was_walked_up(checkpoint):
    """The real engine (the target as its own draft, greedy: every draft accepted), its draft's
    line walked up by hand as a run of stalls would: the plan decodes plainly, and within
    REMEASURE_PLANS speculative steps of a request it starts the line afresh and drafts again."""
    from pdserve.engine import LLM

    target = checkpoint("llama")
    llm = LLM(target, draft_model=target, num_speculative_tokens=4, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate([[5, 6, 7]], greedy)
    spec = llm.engine.speculator
    line = spec.depth.draft_cost
    while line(1) < 1.0:
        line.observe(1, 10.0)
    drafts = spec.stats.num_drafts
    llm.generate([[5, 6, 7]], dataclasses.replace(greedy, max_tokens=AdaptiveDepth.REMEASURE_PLANS + 48))
    assert spec.stats.num_drafts > drafts and line(1) < 1e-1


def test_a_fresh_prompts_catch_up_does_not_feed_the_draft_line(checkpoint):
    """The draft's line prices a pass of the plan's (a token a sequence). A fresh prompt's
    catch-up is one forward over the whole prompt, far cheaper a token: fed to the line, it made
    the line's slope shallow and its intercept steep (on the demo pair, a pass at batch 1
    predicted at 418 µs after a run of batches 1 to 32, against 151 µs without the catch-ups;
    scratch run). Its cost reaches the gate apart (`observe_catch_up`). So every observation of
    a request's passes is of at most two tokens a sequence, and some were made."""
    from pdserve.engine import LLM

    target = checkpoint("llama")
    llm = LLM(target, draft_model=target, num_speculative_tokens=4, num_kv_blocks=64)
    line = llm.engine.speculator.depth.draft_cost
    seen, observe = [], line.observe
    line.observe = lambda n, seconds, count=1, seqs=None: (seen.append(n), observe(n, seconds, count, seqs))
    llm.generate([list(range(5, 65))], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert seen and max(seen) <= 2 and not line.is_guess

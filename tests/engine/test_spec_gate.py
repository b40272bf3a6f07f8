"""The speculation gate, fed by hand (no wall clock in a test): `gate.py` decides, per regime
(batch-size bucket, greedy or sampled), which mode is cheaper and when to measure the other
again; the speculator picks the regime a step falls in. What new requests change (`renew`, a
burst waiting for them) is in test_spec_gate_renew.py; the depth model in
test_spec_adaptive.py, its costs in test_spec_costs.py; how the engine follows both,
test_spec_gate_in_engine.py."""
from __future__ import annotations

import copy
import math

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.costs import LinearCost
from pdserve.engine.spec_decode.depth import AdaptiveDepth
from pdserve.engine.spec_decode.gate import SpeculationGate as Gate
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.speculator import Speculator, StepShape
from gate_driving import drive, measured, runs_of


def test_gate_measures_both_modes_then_keeps_the_cheaper_and_explores_less_often():
    gate = Gate()
    # a burst of each mode to measure them, plain decoding's COLD steps longer (`Gate.observe`);
    # speculation 7.5 ms a token, plain 3.1: plain wins here
    first = drive(gate, 32, Gate.OPENING, spec=(0.30, 40), plain=(0.10, 32), sampled=False)
    assert first == [True] * Gate.BURST + [False] * (Gate.BURST + Gate.COLD)
    decisions = [gate.allow(32) for _ in range(4 * Gate.MAX_PERIOD)]
    bursts = runs_of(decisions, True)
    assert all(length == Gate.BURST for _, length in bursts)  # only exploring bursts speculate
    gaps = [b[0] - a[0] - Gate.BURST for a, b in zip(bursts, bursts[1:])]
    assert bursts[0][0] == Gate.PERIOD
    # each burst that leaves plain winning doubles the wait for the next, up to MAX_PERIOD
    assert gaps[:4] == [2 * Gate.PERIOD, 4 * Gate.PERIOD, 8 * Gate.PERIOD, 16 * Gate.PERIOD]
    assert max(gaps) == Gate.MAX_PERIOD and gaps[-1] == Gate.MAX_PERIOD

    # the winner changes: speculation now costs 1.25 ms a token; its next burst (at most
    # MAX_PERIOD away) measures it so, against plain's steps right before, and it wins; the
    # wait for plain's burst starts again at PERIOD
    after = drive(gate, 32, Gate.MAX_PERIOD + 2 * Gate.PERIOD, spec=(0.05, 40), plain=(0.10, 32), sampled=False)
    start, length = runs_of(after, True)[0]
    assert start < Gate.MAX_PERIOD and length == Gate.BURST
    # plain decoding runs BURST + COLD steps more, to compare the burst with, and then
    # speculation wins; plain's own burst, 150% dearer a token, ends after MIN_BURST steps
    # (`FAR_BEHIND`: its cold steps count for that)
    compared = Gate.BURST + Gate.COLD
    assert runs_of(after, True)[1] == (start + Gate.BURST + compared, Gate.PERIOD)
    assert runs_of(after, False)[1:3] == [(start + Gate.BURST, compared),
                                          (start + Gate.BURST + compared + Gate.PERIOD, Gate.MIN_BURST)]

    # batch 1 keeps its own record: 5 ms a token speculating, 10 plain
    drive(gate, 1, Gate.OPENING, spec=(0.02, 4), plain=(0.01, 1), sampled=False)
    assert [gate.allow(1) for _ in range(Gate.PERIOD + Gate.BURST + Gate.COLD)].count(False) == Gate.BURST + Gate.COLD


def test_a_burst_far_behind_the_running_mode_ends_early():
    """A burst that measures more than FAR_BEHIND dearer a token than the running mode's steps
    before it ends after MIN_BURST measured steps, the opening burst of plain decoding too (at
    batch 1, greedy, on the demo pair plain decoding costs about three times speculation's
    seconds a token); the period doubles from its end. Where the mode's last burst ended so too,
    its first measured step is enough, if it confirms the gap; if not, the burst goes on. One
    within FAR_BEHIND runs its BURST steps, and a burst whose steps go unmeasured is not judged
    by an earlier burst's."""
    gate = Gate()
    opening = drive(gate, 1, Gate.OPENING, spec=(0.002, 5), plain=(0.001, 1), sampled=False)
    assert opening == [True] * Gate.BURST + [False] * Gate.MIN_BURST + [True] * (Gate.OPENING - Gate.BURST - Gate.MIN_BURST)
    later = drive(gate, 1, 4 * Gate.PERIOD, spec=(0.002, 5), plain=(0.001, 1), sampled=False)
    (first, length), (second, length2) = runs_of(later, False)[:2]
    assert length == length2 == 1  # the opening burst lost by far: one confirming step each
    assert second - (first + length) == 2 * Gate.PERIOD  # the period doubled, counted from the cut burst's end
    # plain decoding catches up (30% dearer a token): its next burst's first step does not
    # confirm the gap, and the burst runs whole (its COLD steps, then BURST compared); the one
    # after needs MIN_BURST steps again
    caught_up = drive(gate, 1, 4 * Gate.PERIOD + 2 * Gate.BURST, spec=(0.002, 5), plain=(0.00052, 1), sampled=False)
    assert runs_of(caught_up, False)[0][1] == Gate.BURST + Gate.COLD
    cut = drive(gate, 1, 8 * Gate.PERIOD, spec=(0.002, 5), plain=(0.001, 1), sampled=False)
    assert runs_of(cut, False)[0][1] == Gate.MIN_BURST

    near = Gate()  # speculation 40% dearer: its bursts run whole
    modes = drive(near, 8, Gate.OPENING + Gate.PERIOD + 2 * Gate.BURST, spec=(0.0112, 16), plain=(0.004, 8))
    assert modes[:Gate.BURST] == [True] * Gate.BURST
    assert runs_of(modes, True)[1] == (Gate.OPENING + Gate.PERIOD, Gate.BURST)

    # speculation 100% dearer, and its burst's steps not measured (a prefill joined each): an
    # earlier burst's steps, however dear, do not end it
    far = measured(8, spec=(0.016, 16), plain=(0.004, 8))
    modes = [far.allow(8, True) for _ in range(Gate.PERIOD + Gate.BURST)]
    assert runs_of(modes, True) == [(Gate.PERIOD, Gate.BURST)]


def test_a_burst_is_judged_against_the_steps_right_after_it():
    """Over a run, contexts grow and every step gets dearer. Plain decoding getting dearer than
    speculation's figure from shorter contexts does not bring speculation's burst forward, and
    the scheduled burst is compared with the plain steps right after it, not with a figure that
    mixes its old, cheaper steps: here it costs 0.63 ms a token against plain's 0.65 (within
    KEEP_MARGIN), and plain decoding stays, where the decayed figures (0.58 against 0.65) would
    have switched. The burst is then speculation's figure."""
    gate = measured(8, spec=(0.0060, 12), plain=(0.0036, 8))  # 0.50 ms a token against 0.45: plain wins
    longer = dict(spec=(0.00756, 12), plain=(0.0052, 8))  # at longer contexts: 0.63 against 0.65
    assert drive(gate, 8, Gate.PERIOD, **longer) == [False] * Gate.PERIOD
    assert drive(gate, 8, Gate.BURST, **longer) == [True] * Gate.BURST  # the scheduled burst
    assert drive(gate, 8, 2 * Gate.PERIOD, **longer) == [False] * (2 * Gate.PERIOD)  # stays, and waits twice as long
    assert gate.seconds_per_token(8, True, True) == pytest.approx(0.00063)
    # the burst's decayed figure mixed in the opening burst's cheaper steps, which would have won
    mixed = measured(8, spec=(0.0060, 12), plain=(0.0036, 8))
    for _ in range(Gate.BURST):
        mixed.observe(8, True, *longer["spec"], sampled=True)
    assert mixed.seconds_per_token(8, True, True) * (1 + Gate.KEEP_MARGIN) < 0.00065


def test_unsettled_steps_keep_the_verdict_and_do_not_move_the_schedule():
    """Steps right after a prefill (unsettled: the engine does not measure them) get the current
    verdict, and no burst is spent on them: the measuring bursts wait for settled steps."""
    gate = Gate()
    assert [gate.allow(8, True, settled=False) for _ in range(20)] == [True] * 20  # nothing measured yet
    first = drive(gate, 8, Gate.OPENING, spec=(0.010, 12), plain=(0.004, 8))  # plain wins
    assert first == [True] * Gate.BURST + [False] * (Gate.OPENING - Gate.BURST)  # from the first settled step
    assert gate.allow(8, True) is False
    steps = gate._schedules[gate.regime(8, True)].steps
    assert [gate.allow(8, True, settled=False) for _ in range(3 * Gate.PERIOD)] == [False] * (3 * Gate.PERIOD)
    assert gate._schedules[gate.regime(8, True)].steps == steps
    # the exploring burst comes PERIOD settled steps after the decision, however many unsettled ones came between
    settled = [gate.allow(8, True) for _ in range(Gate.PERIOD + Gate.BURST)]
    assert runs_of(settled, True) == [(Gate.PERIOD - 1, Gate.BURST)]


def test_gate_is_not_turned_by_one_stalled_step_but_follows_a_real_change():
    gate = Gate()
    for _ in range(Gate.OPENING):
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
    for _ in range(Gate.OPENING):
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
    gate = measured(32, spec=(0.040, 64), plain=(0.016, 32))  # 0.625 ms a token against 0.5: plain wins
    cheap = copy.deepcopy(gate)
    gate.observe_switch(32, 0.24, sampled=True)  # a quarter second to catch the draft up
    plain_step = 0.016
    want = math.ceil(0.24 / (Gate.EXPLORE_SHARE * plain_step))  # 750 plain steps pay for one switch
    decisions = [gate.allow(32, True) for _ in range(3 * want)]
    bursts = runs_of(decisions, True)
    assert bursts[0][0] >= want - 1 and all(b[0] - a[0] >= want for a, b in zip(bursts, bursts[1:]))
    # without a switch cost (an n-gram proposer), the first burst comes after PERIOD
    assert runs_of([cheap.allow(32, True) for _ in range(2 * Gate.PERIOD)], True)[0][0] == Gate.PERIOD

    # speculation now costs 10% less a token than plain decoding in its own steps: not enough to
    # repay 0.24 s within PERIOD steps, so its bursts stay bursts; without the switch's cost, the
    # next burst wins
    tenth = dict(spec=(0.0144, 32), plain=(0.016, 32))
    assert all(length == Gate.BURST for _, length in runs_of(drive(gate, 32, 4 * want, **tenth), True))
    assert any(length > Gate.BURST for _, length in runs_of(drive(cheap, 32, 4 * Gate.PERIOD, **tenth), True))
    # and half as dear is
    assert drive(gate, 32, 8 * want, spec=(0.008, 32), plain=(0.016, 32))[-Gate.PERIOD:] == [True] * Gate.PERIOD


def test_at_parity_the_running_mode_stays_and_is_not_measured_early():
    """Once decided, the verdict moves only on a margin: the other mode measuring cheaper by less
    than KEEP_MARGIN (the host's noise, at parity) neither switches the mode nor brings the other
    mode's burst forward; by more, it does both as before."""
    gate = measured(8, spec=(0.0040, 10), plain=(0.0034, 8))  # 0.40 ms a token against 0.425: speculation wins
    assert gate.allow(8, True) is True
    for _ in range(30):  # speculation drifts to 0.44 ms per token: 3.5% dearer than plain's last figure
        gate.observe(8, True, seconds=0.0044, num_tokens=10, sampled=True)
    assert [gate.allow(8, True) for _ in range(Gate.PERIOD - 1)] == [True] * (Gate.PERIOD - 1)
    # the scheduled burst of plain decoding still comes (COLD steps, then BURST compared), and at
    # 0.42 ms (within the margin) does not win
    assert [gate.allow(8, True) for _ in range(Gate.BURST + Gate.COLD)] == [False] * (Gate.BURST + Gate.COLD)
    for _ in range(Gate.BURST):
        gate.observe(8, False, seconds=0.00336, num_tokens=8, sampled=True)
    assert [gate.allow(8, True) for _ in range(Gate.BURST + Gate.REMEASURE_AFTER)] == [True] * (Gate.BURST + Gate.REMEASURE_AFTER)
    for _ in range(30):  # 0.60 ms per token: well past the margin, plain decoding is measured at once
        gate.observe(8, True, seconds=0.0060, num_tokens=10, sampled=True)
    assert [gate.allow(8, True) for _ in range(Gate.BURST + Gate.COLD)] == [False] * (Gate.BURST + Gate.COLD)
    for _ in range(Gate.BURST):
        gate.observe(8, False, seconds=0.00336, num_tokens=8, sampled=True)
    assert [gate.allow(8, True) for _ in range(Gate.BURST)] == [True] * Gate.BURST  # compared with
    assert [gate.allow(8, True) for _ in range(8)] == [False] * 8  # and it wins


def test_a_new_regime_starts_from_its_decided_neighbour():
    """A batch that drains from 32 to 31 (or fills from 31 to 32) keeps the verdict of the
    bucket next to it instead of spending a burst of each mode; it still measures the other
    mode itself after PERIOD steps. Far buckets and the other kind are not neighbours."""
    gate = measured(32, spec=(0.30, 40), plain=(0.10, 32))
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
        for _ in range(Gate.OPENING):
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


def test_a_drafts_catch_up_on_fresh_prompts_counts_against_speculating():
    """A draft model catches up on every fresh prompt before its first proposal, in a step the
    gate does not measure: the gate spreads those seconds over the requests' tokens (seconds per
    prompt token caught up on, times prompt tokens per output token) and adds them to
    speculation's cost. Speculation 5% cheaper a token than plain decoding in its own steps
    loses once a catch-up of 40 µs a prompt token, at 0.75 prompt tokens an output token, is
    added; without the catch-up it wins."""
    gate = Gate()
    for _ in range(Gate.OPENING):
        gate.allow(32, True)
    gate.observe_catch_up(32, seconds=0.12, num_tokens=3000, sampled=True)
    assert gate.catch_up_per_token(32, True) == 0.0  # no request has finished: no lengths yet
    gate.prompt_per_output = 0.75
    assert gate.catch_up_per_token(32, True) == pytest.approx(40e-6 * 0.75)
    assert gate.catch_up_per_token(32, False) == 0.0 and gate.catch_up_per_token(8, True) == 0.0  # per regime
    without = Gate()
    for _ in range(Gate.OPENING):
        without.allow(32, True)
    for g in (gate, without):
        for _ in range(Gate.BURST):
            g.observe(32, True, seconds=0.0095, num_tokens=40, sampled=True)  # 0.2375 ms a token
            g.observe(32, False, seconds=0.0080, num_tokens=32, sampled=True)  # 0.25 ms a token
    assert not gate.allow(32, True)
    assert without.allow(32, True)


def test_a_new_regimes_unmeasured_steps_follow_the_cost_models_verdict():
    """Before a new regime's bursts have measured both modes, its unmeasured steps (right after
    a prefill) take the cost model's verdict (`AdaptiveDepth.verdict`), and speculate while the
    model cannot tell (the kind's acceptance not yet measured); the bursts come all the same.
    At batch 32, temperature 1 on the demo pair, speculating there, where the model already said
    plain decoding wins, cost some 2% of the first 128-token run."""
    depth = AdaptiveDepth(4, True, LinearCost(0.004, 0.0002), LinearCost(0.001, 0.00005))
    gate = Gate(predict=depth.verdict)
    assert depth.verdict(32, True) is None  # no sampled request verified yet
    assert [gate.allow(32, True, settled=False) for _ in range(3)] == [True] * 3
    for i in range(20):  # sampled requests accept about half their drafts; greedy ones all
        depth.record(f"s{i}", 4, 1 + i % 2, sampled=True)
        depth.record(f"g{i}", 4, 4, sampled=False)
    # a step over n tokens costs 4 ms + 0.2 ms a token: verifying 5 tokens a sequence at batch 32
    # (36 ms) cannot pay at about 1.8 tokens each, where at batch 1 it nearly quadruples the tokens
    assert depth.verdict(32, True) is False and depth.verdict(1, True) is True and depth.verdict(32, False) is True
    assert [gate.allow(32, True, settled=False) for _ in range(3)] == [False] * 3
    assert gate.allow(32, False, settled=False) is True and gate.allow(1, True, settled=False) is True
    # the bursts measure both modes, whatever the model said
    assert [gate.allow(32, True) for _ in range(Gate.OPENING)] == [True] * Gate.BURST + [False] * (Gate.OPENING - Gate.BURST)


def test_plain_decoding_getting_dearer_does_not_bring_speculation_forward():
    """While plain decoding runs, its steps getting dearer than speculation's last figure (as
    contexts grow over a run; here speculation's figure is 40% cheaper) say nothing of
    speculation: its burst keeps the schedule and, a switch costing a draft's catch-up, still
    waits for new requests. The first burst of a borrowed verdict waits too, on a switch's cost
    measured in another regime. While speculation runs, its getting dearer than plain's last
    figure (acceptance falling) does bring plain decoding's burst forward, once REMEASURE_AFTER
    steps have passed since the last burst."""
    gate = measured(8, spec=(0.0040, 12), plain=(0.0024, 8))  # 0.33 ms a token against 0.30: plain wins
    gate.observe_switch(8, 0.002, sampled=True)
    neighbour = copy.deepcopy(gate)
    st = gate._schedules[gate.regime(8, True)]
    drifted = drive(gate, 8, Gate.PERIOD + Gate.PERIOD // 2, spec=(0.0040, 12), plain=(0.0044, 8))  # 0.55 ms a token
    assert not any(drifted) and st.due is not None  # due at PERIOD, waiting
    gate.renew(8, True)
    renewed = drive(gate, 8, 2 * Gate.BURST + Gate.COLD, spec=(0.0040, 12), plain=(0.0044, 8))
    assert renewed == [True] * Gate.BURST + [False] * (Gate.BURST + Gate.COLD)  # with the new requests, then plain
    assert gate.allow(8, True) is True  # and it wins
    # a neighbour borrows plain decoding; its first burst of speculation waits, a switch costing
    # here, until its requests are new
    assert neighbour.allow(8, True) is False
    assert not any(neighbour.allow(4, True) for _ in range(Gate.PERIOD + Gate.BURST))
    neighbour.renew(4, True)
    assert [neighbour.allow(4, True) for _ in range(Gate.BURST)] == [True] * Gate.BURST

    # speculation running: its acceptance falls, and plain decoding is measured again early
    spec_wins = measured(8, spec=(0.0030, 12), plain=(0.0024, 8))  # 0.25 ms a token against 0.30
    assert drive(spec_wins, 8, Gate.REMEASURE_AFTER, spec=(0.0030, 12), plain=(0.0024, 8)) == [True] * Gate.REMEASURE_AFTER
    fell = drive(spec_wins, 8, 28, spec=(0.0060, 12), plain=(0.0024, 8))  # 0.50 ms a token
    start, length = runs_of(fell, False)[0]
    assert start < 8 and length == Gate.BURST + Gate.COLD  # measured at once
    assert fell[start + length:] == [True] * Gate.BURST + [False] * (28 - start - length - Gate.BURST)  # and it wins


def test_the_first_verdict_is_speculations_only_when_it_wins_by_the_margin():
    """Speculation costs more than its measured steps show (the ragged end of a batch), so where
    the opening bursts measure within KEEP_MARGIN of each other plain decoding is the verdict;
    speculation clearly cheaper is."""
    par = measured(32, spec=(0.0098, 35), plain=(0.0091, 32))  # 0.280 ms a token against 0.284
    assert drive(par, 32, Gate.PERIOD - 1, spec=(0.0098, 35), plain=(0.0091, 32)) == [False] * (Gate.PERIOD - 1)
    wins = measured(32, spec=(0.0090, 35), plain=(0.0091, 32))  # 0.257 against 0.284: 10% cheaper
    assert drive(wins, 32, Gate.PERIOD - 1, spec=(0.0090, 35), plain=(0.0091, 32)) == [True] * (Gate.PERIOD - 1)


def test_plain_steps_right_after_speculative_ones_are_not_compared():
    """Plain steps right after speculative ones run slow while the target's weights and caches
    come back into the CPU's caches (at batch 32 on the Xeon, 36% at first). The first COLD of
    them are neither compared nor in plain decoding's figure: plain's bursts (the opening one
    too) and its steps after a burst of speculation run COLD steps longer. Here plain decoding
    costs 0.25 ms a token warm and 0.34 cold, speculation 0.30: judged on cold steps, as a gate
    without them does, plain decoding loses its opening burst and every burst after."""
    spec, warm, cold = (0.0105, 35), (0.0080, 32), (0.0108, 32)  # 0.30, 0.25 and 0.34 ms a token

    def drive(gate: Gate, steps: int) -> list[bool]:
        modes, since = [], Gate.COLD + 1  # plain steps since the last speculative one
        for _ in range(steps):
            mode = gate.allow(32, True)
            since = 0 if mode else since + 1
            gate.observe(32, mode, *(spec if mode else cold if since <= Gate.COLD else warm), sampled=True)
            modes.append(mode)
        return modes

    gate = Gate()
    assert drive(gate, Gate.OPENING + 1) == [True] * Gate.BURST + [False] * (Gate.BURST + Gate.COLD + 1)
    assert gate.seconds_per_token(32, False, True) == pytest.approx(0.00025)  # warm steps only
    later = drive(gate, 4 * Gate.PERIOD)
    assert [length for _, length in runs_of(later, True)] == [Gate.BURST] * 2  # exploring bursts only: they lost

    class NoCold(Gate):
        COLD, OPENING = 0, 2 * Gate.BURST

    blind = NoCold()
    assert drive(blind, 4 * Gate.PERIOD).count(True) > 3 * Gate.PERIOD  # speculation won, and kept

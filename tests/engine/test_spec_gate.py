"""The speculation gate, fed by hand (no wall clock in a test): `gate.py` decides, per regime
(batch-size bucket, greedy or sampled), which mode is cheaper and when to measure the other
again; the speculator picks the regime a step falls in. The depth model is in
test_spec_adaptive.py; how the engine follows both, test_spec_gate_in_engine.py."""
from __future__ import annotations

import copy
import math

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.depth import AdaptiveDepth, LinearCost
from pdserve.engine.spec_decode.gate import SpeculationGate as Gate
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.speculator import Speculator, StepShape


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


def _measured(batch_size: int, spec: tuple[float, int], plain: tuple[float, int]) -> Gate:
    """A gate whose opening bursts at `batch_size`, temperature 1, measured each speculative step
    at spec and each plain one at plain (seconds, tokens emitted)."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(batch_size, True)
    for _ in range(Gate.BURST):
        gate.observe(batch_size, True, seconds=spec[0], num_tokens=spec[1], sampled=True)
        gate.observe(batch_size, False, seconds=plain[0], num_tokens=plain[1], sampled=True)
    return gate


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
    gate = _measured(8, spec=(0.0060, 10), plain=(0.0040, 8))  # 0.60 ms a token against 0.50: plain wins
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
    gate = _measured(32, spec=(0.040, 64), plain=(0.016, 32))  # 0.625 ms a token against 0.5: plain wins
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
    # and half as dear is
    for _ in range(40):
        gate.observe(32, True, seconds=0.008, num_tokens=32, sampled=True)
    assert all(gate.allow(32, True) for _ in range(Gate.PERIOD))


def test_a_burst_of_speculation_waits_for_new_requests_when_switching_costs():
    """While plain decoding wins and a switch costs a draft's catch-up, a burst of speculation
    that comes due waits until most of the batch is new (`renew`), when the draft has little to
    catch up on, and starts within FRESH steps of it; with no new requests, after one period more.
    Without a switch cost (an n-gram proposer) bursts keep the schedule."""
    gate = _measured(8, spec=(0.010, 12), plain=(0.004, 8))  # plain wins by 67%
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
    gate = _measured(8, spec=(0.0040, 10), plain=(0.0034, 8))  # 0.40 ms a token against 0.425: speculation wins
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


def test_a_new_regime_starts_from_its_decided_neighbour():
    """A batch that drains from 32 to 31 (or fills from 31 to 32) keeps the verdict of the
    bucket next to it instead of spending a burst of each mode; it still measures the other
    mode itself after PERIOD steps. Far buckets and the other kind are not neighbours."""
    gate = _measured(32, spec=(0.30, 40), plain=(0.10, 32))
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


def test_a_drafts_catch_up_on_fresh_prompts_counts_against_speculating():
    """A draft model catches up on every fresh prompt before its first proposal, in a step the
    gate does not measure: the gate spreads those seconds over the requests' tokens (seconds per
    prompt token caught up on, times prompt tokens per output token) and adds them to
    speculation's cost. Speculation 5% cheaper a token than plain decoding in its own steps
    loses once a catch-up of 40 µs a prompt token, at 0.75 prompt tokens an output token, is
    added; without the catch-up it wins."""
    gate = Gate()
    for _ in range(2 * Gate.BURST):
        gate.allow(32, True)
    gate.observe_catch_up(32, seconds=0.12, num_tokens=3000, sampled=True)
    assert gate.catch_up_per_token(32, True) == 0.0  # no request has finished: no lengths yet
    gate.prompt_per_output = 0.75
    assert gate.catch_up_per_token(32, True) == pytest.approx(40e-6 * 0.75)
    assert gate.catch_up_per_token(32, False) == 0.0 and gate.catch_up_per_token(8, True) == 0.0  # per regime
    without = Gate()
    for _ in range(2 * Gate.BURST):
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
    assert [gate.allow(32, True) for _ in range(2 * Gate.BURST)] == [True] * Gate.BURST + [False] * Gate.BURST


def test_a_burst_of_speculation_brought_forward_by_a_small_margin_waits_for_new_requests():
    """Speculation measuring cheaper than plain decoding by more than KEEP_MARGIN brings its
    burst forward, but where a switch costs a draft's catch-up and the margin is under
    RENEW_MARGIN (plain steps getting dearer as contexts grow, against speculation's figure
    from shorter ones), the burst waits for new requests; by RENEW_MARGIN or more it comes at
    once. The first burst of a borrowed verdict waits too, on a switch's cost measured in
    another regime."""
    def plain_wins() -> Gate:
        gate = _measured(8, spec=(0.0040, 12), plain=(0.0024, 8))  # 0.33 ms a token against 0.30: plain wins
        gate.observe_switch(8, 0.002, sampled=True)
        assert gate.allow(8, True) is False
        return gate

    gate, urgent, neighbour = plain_wins(), plain_wins(), plain_wins()
    st = gate._schedules[gate.regime(8, True)]
    for _ in range(30):  # plain drifts to 0.36 ms a token: speculation 9% cheaper
        gate.observe(8, False, seconds=0.00288, num_tokens=8, sampled=True)
    assert not any(gate.allow(8, True) for _ in range(Gate.PERIOD // 2)) and st.due is not None
    gate.renew(8, True)
    assert [gate.allow(8, True) for _ in range(Gate.BURST)] == [True] * Gate.BURST  # with the new requests
    for _ in range(Gate.BURST):
        gate.observe(8, True, seconds=0.0040, num_tokens=12, sampled=True)
    assert gate.allow(8, True) is True  # and it wins
    for _ in range(30):  # plain drifts to 0.50 ms a token: speculation 50% cheaper
        urgent.observe(8, False, seconds=0.0040, num_tokens=8, sampled=True)
    assert [urgent.allow(8, True) for _ in range(Gate.BURST)] == [True] * Gate.BURST  # at once
    # a neighbour borrows plain decoding; its first burst of speculation waits, a switch costing
    # here, until its requests are new
    assert not any(neighbour.allow(4, True) for _ in range(Gate.PERIOD + Gate.BURST))
    neighbour.renew(4, True)
    assert [neighbour.allow(4, True) for _ in range(Gate.BURST)] == [True] * Gate.BURST

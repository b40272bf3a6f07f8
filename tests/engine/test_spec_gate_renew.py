"""The speculation gate and new requests, fed by hand (no wall clock in a test): most of a batch
new brings the losing mode's next burst forward (`SpeculationGate.renew`) unless it lost by far,
or always where no burst has checked the opening's verdict; a burst of speculation that switching
makes dear waits for new requests. The rest of the gate is in test_spec_gate.py."""
from __future__ import annotations

import copy

import pytest

from pdserve.engine.spec_decode.gate import SpeculationGate as Gate
from gate_driving import drive, measured, runs_of


def test_gate_keeps_greedy_and_sampled_batches_apart_and_renews_for_new_requests():
    gate = Gate()
    drive(gate, 1, Gate.OPENING, spec=(0.010, 5), plain=(0.0028, 1), sampled=False)  # greedy: 2 ms a token, plain 2.8
    drive(gate, 1, Gate.OPENING, spec=(0.010, 2), plain=(0.003, 1), sampled=True)  # sampled: 5 ms a token, plain 3
    assert [gate.allow(1, False) for _ in range(Gate.PERIOD)].count(True) == Gate.PERIOD
    assert [gate.allow(1, True) for _ in range(Gate.PERIOD)].count(True) == 0

    # sampled batches stay plain, and the waits between exploring bursts grow long
    for _ in range(3 * Gate.MAX_PERIOD):
        gate.allow(1, True)
    in_burst = False
    while (speculates := gate.allow(1, True)) or not in_burst:  # to the end of an exploring burst
        in_burst = in_burst or speculates
    for _ in range(Gate.BURST + Gate.COLD):  # and of the plain steps it is compared with
        gate.allow(1, True)
    far = copy.deepcopy(gate)
    far.renew(1, True)  # speculation lost by 67%: new requests do not bring its burst forward
    assert True not in [far.allow(1, True) for _ in range(Gate.PERIOD + 1)]
    for _ in range(30):  # now it loses by 5% only
        gate.observe(1, True, seconds=0.0063, num_tokens=2, sampled=True)
    gate.allow(1, True)
    renewed = copy.deepcopy(gate)
    renewed.renew(1, True)  # most requests are new: measured again within PERIOD
    assert True not in [gate.allow(1, True) for _ in range(Gate.PERIOD + 1)]
    assert True in [renewed.allow(1, True) for _ in range(Gate.PERIOD + 1)]


def test_a_burst_of_speculation_waits_for_new_requests_when_switching_costs():
    """While plain decoding wins and a switch costs a draft's catch-up, a burst of speculation
    that comes due waits until most of the batch is new (`renew`), when the draft has little to
    catch up on, and starts within FRESH steps of it; with no new requests, after MAX_PERIOD
    steps more.
    Without a switch cost (an n-gram proposer) bursts keep the schedule."""
    gate = measured(8, spec=(0.010, 12), plain=(0.004, 8))  # plain wins by 67%
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
    assert fresh[Gate.BURST:] == [False] * Gate.BURST  # plain steps to compare the burst with
    waited = [gate.allow(8, True) for _ in range(2 * Gate.MAX_PERIOD)]  # no new requests: the period, then MAX_PERIOD
    start, length = runs_of(waited, True)[0]
    # the burst left plain winning: the period doubled, to 2 * PERIOD from the burst's end, and
    # the burst due then waited for new requests as long as any wait runs
    assert length == Gate.BURST and start + Gate.BURST == 2 * Gate.PERIOD + Gate.MAX_PERIOD
    assert runs_of([no_switch.allow(8, True) for _ in range(2 * Gate.PERIOD)], True)[0][0] == Gate.PERIOD


def test_new_requests_bring_a_burst_forward_on_its_last_same_context_verdict():
    """How far the losing mode lost, for `renew`, is its last burst's verdict against the
    running mode's steps right after it, not the decayed figures. Over a run plain decoding gets
    dearer as contexts grow; speculation's figure stays that of its burst early in the run. Here
    speculation lost its burst by 29% at the same contexts; by the end of the run plain's figure
    is within 5% of it, but the next batch does not bring the burst back: the waits still double.
    A burst that lost by 5% is brought forward by new requests."""
    def lost_burst(spec_step: tuple[float, int]) -> Gate:
        gate = measured(8, spec=(0.0060, 12), plain=(0.0032, 8))  # 0.50 ms a token against 0.40
        assert drive(gate, 8, Gate.PERIOD, spec=spec_step, plain=(0.0032, 8)) == [False] * Gate.PERIOD
        assert drive(gate, 8, 2 * Gate.BURST + Gate.COLD + 1, spec=spec_step, plain=(0.0032, 8)) == (
            [True] * Gate.BURST + [False] * (Gate.BURST + Gate.COLD + 1))  # the burst, plain's steps, the verdict
        return gate

    clear = lost_burst((0.0062, 12))  # 0.517 ms a token: 29% dearer than plain's 0.40
    assert clear._schedules[clear.regime(8, True)].lost_by == pytest.approx(0.0062 / 12 / 0.0004 - 1)
    later = drive(clear, 8, 40, spec=(0.0062, 12), plain=(0.0040, 8))  # plain at 0.50 ms a token, contexts longer
    assert not any(later)
    costs = clear._costs(clear._schedules[clear.regime(8, True)], 8, True)
    assert clear._gap(costs) < Gate.RENEW_MARGIN  # the decayed figures, of different ages, read close
    clear.renew(8, True)
    assert not any(drive(clear, 8, Gate.PERIOD + Gate.BURST, spec=(0.0062, 12), plain=(0.0032, 8)))

    close = lost_burst((0.0050, 12))  # 0.417 ms a token: 4% dearer, within KEEP_MARGIN
    assert close._schedules[close.regime(8, True)].lost_by == pytest.approx(0.0050 / 12 / 0.0004 - 1)
    drive(close, 8, 40, spec=(0.0050, 12), plain=(0.0032, 8))
    close.renew(8, True)
    assert any(drive(close, 8, Gate.PERIOD + Gate.BURST, spec=(0.0050, 12), plain=(0.0032, 8)))


def test_new_requests_check_a_verdict_only_the_opening_measured():
    """The opening's four steps a mode made plain decoding the verdict (speculation measured 25%
    dearer a token: a noisy host), where speculating is in fact 17% cheaper. The next new requests
    bring a burst of speculation on at once, and its verdict turns the gate; without new requests
    the gate keeps plain decoding through its period. Once a burst has checked the verdict, new
    requests bring the next one forward only where the loser lost by less than RENEW_MARGIN
    (`test_new_requests_bring_a_burst_forward_on_its_last_same_context_verdict`)."""
    true_spec, plain = (0.0040, 12), (0.0032, 8)  # 0.33 ms a token against 0.40
    gate = measured(8, spec=(0.0060, 12), plain=plain)  # the opening: 0.50 against 0.40
    assert not any(drive(gate, 8, 4, true_spec, plain))
    assert not gate._schedules[gate.regime(8, True)].confirmed
    unrenewed = copy.deepcopy(gate)
    gate.renew(8, True)
    modes = drive(gate, 8, 2 * Gate.BURST + Gate.COLD + 8, true_spec, plain)
    assert modes[:Gate.BURST] == [True] * Gate.BURST  # the burst, at once
    assert modes[-8:] == [True] * 8  # it won at the same contexts: speculation is the verdict now
    assert gate._schedules[gate.regime(8, True)].confirmed
    assert not any(drive(unrenewed, 8, Gate.PERIOD - 8, true_spec, plain))

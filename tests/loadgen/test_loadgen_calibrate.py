"""`loadgen.calibrate` on measurements whose overheads are known: points made by simulating a
profile with overheads added (per request, per decode step, per sequence of a step, per prompt
prefilled, per prompt handed over) are calibrated from the profile without them, and the
overheads must come back, both points predicted as "measured". The real deployment's calibration is tests/disagg/test_calibrate.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pdserve.loadgen.bench import BenchConfig
from pdserve.loadgen.calibrate import Calibration, calibrated, point, with_overheads
from pdserve.loadgen.costs import CostProfile, SpeculationCost, StepCost, TransferCost, WorkerLimits
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.simulator import Shape, bench_inputs
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind

BASE = CostProfile("m", "h", prefill=StepCost(0.002, per_token_s=2e-5), decode=StepCost(1e-3, per_seq_s=5e-5),
                   transfer=TransferCost(1000, 1e9), limits=WorkerLimits(max_num_seqs=32),
                   speculation=SpeculationCost(3, 0.7, 0.1, step=StepCost(2e-3, per_seq_s=1e-4)))
UNLOADED = BenchConfig(target="unused:0", workload=WorkloadConfig(
    WorkloadKind.RANDOM, LengthDistribution.parse("uniform:32,256"), LengthDistribution.parse("uniform:16,64"),
    vocab_size=300), rates=(math.inf,), num_requests=40, max_concurrency=1, seed=100)
LOADED_RATE = 150.0  # about eight requests in flight on BASE with the overheads below


def _measured(truth: CostProfile, shape: Shape):
    """What a deployment costing `truth` would measure at both points (the simulator standing in):
    requests one at a time, and the same requests arriving at LOADED_RATE (the loaded inputs)."""
    unloaded = point(truth, shape, bench_inputs(UNLOADED, 0.01), UNLOADED.seed)
    inputs = bench_inputs(dataclasses.replace(UNLOADED, rates=(LOADED_RATE,), max_concurrency=None), LOADED_RATE)
    return unloaded, inputs, point(truth, shape, inputs, UNLOADED.seed)


def _record(tokens: list[int], steps: list[int] | None = None):
    from pdserve.loadgen.records import RequestRecord
    r = RequestRecord(0, 0.0, sum(tokens), 10, sent_s=0.0)
    for i, n in enumerate(tokens):
        r.add_delta(0.01 * (i + 1), n, steps[i] if steps else 0)
    return r


@pytest.mark.parametrize("shape", [Shape(1, 1), Shape(1, 1, True), Shape(0, 2)], ids=lambda s: s.label)
def test_known_overheads_come_back(shape):
    handover = 0.0 if shape.is_colocated else 0.004
    truth = with_overheads(BASE, request_s=0.005, step_s=0.001, per_seq_s=3e-4, prefill_s=0.002, handover_s=handover)
    unloaded, inputs, loaded = _measured(truth, shape)
    assert loaded.steady_tpot_s > 2 * unloaded.steady_tpot_s  # the loaded point's steps do hold several sequences
    profile, cal = calibrated(BASE, shape, unloaded, UNLOADED, loaded, inputs)
    # a prompt's prefill overhead and the request's are told apart only by queueing under load,
    # and a median TTFT of 40 requests moves in jumps: their sum is what comes back closely
    assert cal.request_overhead_s + cal.prefill_overhead_s == pytest.approx(0.007, rel=0.05)
    assert cal.prefill_overhead_s > 0.0005
    # colocated, prompts are prefilled inside decode steps: per-sequence and prefill costs mix
    assert cal.per_seq_overhead_s == pytest.approx(3e-4, rel=0.2 if shape.is_colocated else 0.05)
    assert cal.step_overhead_s == pytest.approx(0.001, rel=0.1)
    # the hand-over is the gap between the prefill worker's token and the decode worker's first
    # step, which a step's length rounds: within 10%
    assert cal.handover_s == pytest.approx(handover, rel=0.1, abs=1e-9)
    assert profile.decode.per_seq_s == pytest.approx(5e-5 + cal.per_seq_overhead_s)
    assert profile.speculation.step.fixed_s == pytest.approx(2e-3 + cal.step_overhead_s)
    assert profile.prefill.per_seq_s == pytest.approx(cal.prefill_overhead_s) and "calibration" in profile.notes
    assert profile.transfer.latency_s == pytest.approx(cal.handover_s)
    # and the calibrated profile predicts both points as measured
    again = point(profile, shape, inputs, UNLOADED.seed)
    assert cal.calibrated_loaded == again
    assert again.steady_tpot_s == pytest.approx(loaded.steady_tpot_s, rel=0.05)
    assert again.tpot_s == pytest.approx(loaded.tpot_s, rel=0.1)
    assert again.ttft_s == pytest.approx(loaded.ttft_s, rel=0.1)
    first = point(profile, shape, bench_inputs(UNLOADED, 0.01), UNLOADED.seed)
    for name in ("ttft_s", "tpot_s", "steady_tpot_s", "first_gap_s"):
        assert getattr(first, name) == pytest.approx(getattr(unloaded, name), rel=0.03), name
    assert Calibration.from_json(cal.to_json()) == cal


def test_unloaded_only_puts_the_step_excess_in_the_fixed_cost():
    truth = with_overheads(BASE, request_s=0.002, step_s=0.0015)
    unloaded, _, _ = _measured(truth, Shape(1, 1))
    profile, cal = calibrated(BASE, Shape(1, 1), unloaded, UNLOADED)
    assert cal.step_overhead_s == pytest.approx(0.0015, rel=0.02) and cal.per_seq_overhead_s == 0
    assert cal.request_overhead_s == pytest.approx(0.002, rel=0.02) and cal.prefill_overhead_s == 0
    assert cal.loaded_concurrency == 0 and profile.decode.per_seq_s == BASE.decode.per_seq_s
    assert cal.handover_s == 0 and cal.measured_loaded is None


def test_a_simulation_slower_than_measured_changes_nothing():
    slow = with_overheads(BASE, request_s=0.01, step_s=0.002, per_seq_s=1e-4)
    unloaded, inputs, loaded = _measured(BASE, Shape(1, 1))
    profile, cal = calibrated(slow, Shape(1, 1), unloaded, UNLOADED, loaded, inputs)
    assert (cal.request_overhead_s, cal.step_overhead_s, cal.per_seq_overhead_s, cal.prefill_overhead_s,
            cal.handover_s) == (0,) * 5
    assert dataclasses.replace(profile, notes=slow.notes) == slow


def test_acceptance_comes_from_the_tokens_each_decode_step_streamed():
    from pdserve.loadgen.calibrate import acceptance
    from pdserve.loadgen.costs import SpeculationCost
    record = _record
    # the first delta (the prefill's token) and the last (cut short by max_tokens) aside, steps of
    # 3 and 4 tokens: 3.5 a step at k = 4
    alpha = acceptance([record([1, 3, 4, 3, 1]), record([1, 4, 2])], k=4)
    assert SpeculationCost(4, alpha, 0.1).mean_tokens_per_step == pytest.approx(3.5)
    assert acceptance([record([1, 2])], k=4) is None  # no whole decode step seen
    # deltas that say how many engine steps they carry (a merged backlog, a stream_interval group)
    # count as that many steps: 4 tokens, 7 over two steps and 3 are 14 over 4 steps, not 3
    alpha = acceptance([record([1, 4, 7, 3, 1], [1, 1, 2, 1, 1])], k=4)
    assert SpeculationCost(4, alpha, 0.1).mean_tokens_per_step == pytest.approx(3.5)
    assert acceptance([record([1, 7, 3, 1])], k=4) == acceptance([record([1, 4, 6, 1])], k=4)  # uncounted: one each
    from pdserve.loadgen.calibrate import _check_speculation
    _check_speculation([record([1, 3, 2, 1, 1], [1, 3, 2, 1, 1])], speculate=False)  # plain, merged: 1 a step
    with pytest.raises(ValueError, match="streamed 2.00 tokens each"):
        _check_speculation([record([1, 3, 2, 1, 1], [1, 1, 1, 1, 1])], speculate=False)
    profile, cal = calibrated(BASE, Shape(1, 1, True), *_measured(BASE, Shape(1, 1, True))[:1], UNLOADED,
                              acceptance_rate=0.5)
    assert profile.speculation.acceptance_rate == 0.5 and cal.acceptance_rate == 0.5


OPEN_RATE = 60.0  # requests/s: under LOADED_RATE's saturation, the prefill side busy but not queued for long


def test_an_open_loop_point_sets_the_prompt_overhead_and_both_loads_come_back():
    # the loaded point replays a saturated run, the open one arrives at a rate the system can carry:
    # the prefill overhead is fitted on the second's TTFT, and both are predicted as "measured"
    shape = Shape(1, 1)
    truth = with_overheads(BASE, request_s=0.002, step_s=0.001, per_seq_s=3e-4, prefill_s=0.004, handover_s=0.002)
    unloaded, inputs, loaded = _measured(truth, shape)
    open_inputs = bench_inputs(dataclasses.replace(UNLOADED, rates=(OPEN_RATE,), max_concurrency=None), OPEN_RATE)
    opened = point(truth, shape, open_inputs, UNLOADED.seed)
    assert opened.ttft_s < 0.8 * loaded.ttft_s  # a lighter load than the loaded point's
    profile, cal = calibrated(BASE, shape, unloaded, UNLOADED, loaded, inputs, opened=opened,
                              open_inputs=open_inputs, open_rate=OPEN_RATE)
    assert cal.open_rate == OPEN_RATE and cal.measured_open == opened
    assert cal.prefill_overhead_s == pytest.approx(0.004, rel=0.15)
    assert cal.request_overhead_s + cal.prefill_overhead_s == pytest.approx(0.006, rel=0.05)
    assert cal.per_seq_overhead_s == pytest.approx(3e-4, rel=0.05)
    assert cal.calibrated_open == point(profile, shape, open_inputs, UNLOADED.seed)
    assert cal.calibrated_open.ttft_s == pytest.approx(opened.ttft_s, rel=0.05)
    assert cal.calibrated_loaded.ttft_s == pytest.approx(loaded.ttft_s, rel=0.1)
    assert "open loop at 60.00 requests/s" in cal.describe()
    assert Calibration.from_json(cal.to_json()) == cal


def test_speculation_only_adds_to_the_speculative_steps_alone():
    # a plain calibration puts the decode step's overheads on speculative steps too; a speculating
    # deployment whose steps cost more beyond that gets the rest on its speculative steps only
    from pdserve.loadgen.calibrate_speculation import (calibrated_speculation, with_speculation_overheads,
                                                       with_speculation_prefill)

    shape = Shape(1, 1, True)
    drafting = dataclasses.replace(BASE, speculation=dataclasses.replace(
        BASE.speculation, prefill=StepCost(0.002, per_token_s=2.5e-5)))  # prefills that fill the draft's cache
    plain = with_overheads(drafting, request_s=0.002, step_s=0.001, per_seq_s=3e-4, prefill_s=0.004,
                           handover_s=0.002)
    assert plain.speculation.prefill.per_seq_s == pytest.approx(0.004)  # the plain pair's prompt overhead
    # the speculating pair's steps cost more beyond the plain ones; its prompts less
    truth = with_speculation_prefill(with_speculation_overheads(plain, step_s=0.0015, per_seq_s=2e-4), 0.0015)
    unloaded, inputs, loaded = _measured(truth, shape)
    open_inputs = bench_inputs(dataclasses.replace(UNLOADED, rates=(OPEN_RATE,), max_concurrency=None), OPEN_RATE)
    opened = point(truth, shape, open_inputs, UNLOADED.seed)
    profile, cal = calibrated_speculation(plain, shape, unloaded, UNLOADED, loaded, inputs, acceptance_rate=0.7,
                                          loaded_concurrency=8, opened=opened, open_inputs=open_inputs,
                                          open_rate=OPEN_RATE)
    assert cal.speculation_only and cal.spec_step_overhead_s == pytest.approx(0.0015, rel=0.1)
    assert cal.spec_per_seq_overhead_s == pytest.approx(2e-4, rel=0.1)
    assert cal.spec_prefill_s == pytest.approx(0.0015, rel=0.15)
    assert profile.speculation.prefill.per_seq_s == cal.spec_prefill_s
    assert (cal.request_overhead_s, cal.step_overhead_s, cal.per_seq_overhead_s, cal.prefill_overhead_s) == (0,) * 4
    # the plain decode step, the prefill and the hand-over are the plain calibration's
    assert (profile.decode, profile.prefill, profile.transfer) == (plain.decode, plain.prefill, plain.transfer)
    assert profile.speculation.step.fixed_s == pytest.approx(plain.speculation.step.fixed_s + cal.spec_step_overhead_s)
    assert "speculation_calibration" in profile.notes
    again = point(profile, shape, inputs, UNLOADED.seed)
    assert again == cal.calibrated_loaded and again.steady_tpot_s == pytest.approx(loaded.steady_tpot_s, rel=0.05)
    assert cal.calibrated_open.ttft_s == pytest.approx(opened.ttft_s, rel=0.05) and cal.open_rate == OPEN_RATE
    assert point(profile, shape, bench_inputs(UNLOADED, 0.01), UNLOADED.seed).steady_tpot_s == pytest.approx(
        unloaded.steady_tpot_s, rel=0.03)
    assert "each prompt in a prefill with the draft 1.5" in cal.describe()
    assert Calibration.from_json(cal.to_json()) == cal
    # without an open-loop point the prompts keep the plain pair's cost
    profile, cal = calibrated_speculation(plain, shape, unloaded, UNLOADED, loaded, inputs)
    assert math.isnan(cal.spec_prefill_s) and profile.speculation.prefill == plain.speculation.prefill
    with pytest.raises(ValueError, match="speculating deployment"):
        calibrated_speculation(plain, Shape(1, 1), unloaded, UNLOADED)
    with pytest.raises(ValueError, match="speculative steps were measured"):
        calibrated_speculation(dataclasses.replace(plain, speculation=None), shape, unloaded, UNLOADED)


# a colocated worker's own steps: (decode fixed, per sequence), each prompt's prefill, the request's,
# and whether the points tell the per-sequence and per-prompt overheads apart. As on the demo pair
# (BENCHMARKS.md, planner validation) a prompt costs several decode steps: they do. At half that,
# pairs along a valley predict the points alike, and which one the grid lands on moves with it
COLOCATED_TRUTHS = [((0.002, 3e-4), 0.008, 0.0005, True), ((0.003, 4e-4), 0.004, 0.0005, False)]


@pytest.mark.parametrize("decode,prompt,request_s,apart", COLOCATED_TRUTHS)
def test_colocated_only_gives_colocated_workers_steps_of_their_own(decode, prompt, request_s, apart):
    # a disaggregated calibration prices a colocated worker's prompts and steps as the pair's; a
    # colocated deployment whose steps cost more and whose prompts cost less gets its own, and
    # the disaggregated shapes keep theirs
    from pdserve.loadgen.calibrate_colocated import calibrated_colocated
    from pdserve.loadgen.costs import ColocatedCost

    shape = Shape(0, 2)
    disaggregated = with_overheads(BASE, request_s=0.002, step_s=0.001, per_seq_s=3e-4, prefill_s=0.010,
                                   handover_s=0.002)
    own = ColocatedCost(StepCost(decode[0], per_seq_s=decode[1]), StepCost(0.002, per_seq_s=prompt, per_token_s=2e-5),
                        request_s)
    truth = dataclasses.replace(disaggregated, colocated=own)
    unloaded, inputs, loaded = _measured(truth, shape)
    open_inputs = bench_inputs(dataclasses.replace(UNLOADED, rates=(OPEN_RATE,), max_concurrency=None), OPEN_RATE)
    opened = point(truth, shape, open_inputs, UNLOADED.seed)
    before = point(disaggregated, shape, open_inputs, UNLOADED.seed)
    assert before.ttft_s > 1.2 * opened.ttft_s  # priced as the pair's, the prompts cost too much here
    profile, cal = calibrated_colocated(disaggregated, shape, unloaded, UNLOADED, loaded, inputs, 8, opened,
                                        open_inputs, OPEN_RATE)
    got = profile.colocated
    assert cal.colocated_only and got is not None
    # each comes back whole: the step's fixed and per-sequence seconds, each prompt's, the request's
    if apart:
        assert got.decode.fixed_s == pytest.approx(decode[0], rel=0.1)
        assert got.decode.per_seq_s == pytest.approx(decode[1], rel=0.1)
        assert got.prefill.per_seq_s == pytest.approx(prompt, rel=0.15)
        assert got.request_overhead_s + got.prefill.per_seq_s == pytest.approx(prompt + request_s, rel=0.01)
    else:  # along the valley: the one-sequence step whole, the rest told apart loosely
        assert got.decode.fixed_s + got.decode.per_seq_s == pytest.approx(sum(decode), rel=0.01)
        assert got.decode.per_seq_s == pytest.approx(decode[1], rel=0.3)
    # what the profile measured stays: per-token and attention costs, the prefill's fixed cost
    assert got.prefill.per_token_s == BASE.prefill.per_token_s and got.decode.per_token_s == BASE.decode.per_token_s
    # the disaggregated shapes run on what they did
    assert (profile.decode, profile.prefill, profile.transfer, profile.speculation) == (
        disaggregated.decode, disaggregated.prefill, disaggregated.transfer, disaggregated.speculation)
    assert point(profile, Shape(1, 1), inputs, UNLOADED.seed) == point(disaggregated, Shape(1, 1), inputs, UNLOADED.seed)
    # and the colocated one predicts all three points as measured
    assert cal.calibrated_open == point(profile, shape, open_inputs, UNLOADED.seed)
    assert cal.calibrated_open.ttft_s == pytest.approx(opened.ttft_s, rel=0.05)
    assert cal.calibrated_loaded.steady_tpot_s == pytest.approx(loaded.steady_tpot_s, rel=0.05)
    assert cal.calibrated_open.steady_tpot_s == pytest.approx(opened.steady_tpot_s, rel=0.05)
    assert cal.calibrated_loaded.ttft_s == pytest.approx(loaded.ttft_s, rel=0.05)
    first = point(profile, shape, bench_inputs(UNLOADED, 0.01), UNLOADED.seed)
    assert first.steady_tpot_s == pytest.approx(unloaded.steady_tpot_s, rel=0.03)
    assert first.ttft_s == pytest.approx(unloaded.ttft_s, rel=0.05 if apart else 0.5)
    assert cal.simulated_unloaded == point(disaggregated, shape, bench_inputs(UNLOADED, 0.01), UNLOADED.seed)
    assert "colocated worker's own steps" in cal.describe() and "colocated_calibration" in profile.notes
    assert Calibration.from_json(cal.to_json()) == cal
    assert CostProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    for wrong in (Shape(1, 1), Shape(0, 2, True)):
        with pytest.raises(ValueError, match="plain colocated deployment"):
            calibrated_colocated(disaggregated, wrong, unloaded, UNLOADED)



@pytest.mark.parametrize("tokens, steps, expected", [
    # the prefill's token, one token a step, the last step cut short: plain
    ([1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1.0, 1.0, 1.0]),
    # a plain deployment whose stream fell behind its engine: merged deltas are still one token a step
    ([1, 3, 2, 1, 1], [1, 3, 2, 1, 1], [1.0] * 6),
    # plain steps until the draft's K/V landed, then four tokens a step
    ([1, 1, 1, 4, 4, 4, 2], [1, 1, 1, 1, 1, 1, 1], [4.0, 4.0, 4.0]),
    # the plain steps and the first speculative one merged into one delta: skipped, not read as 2 a step
    ([1, 1, 6, 8, 4, 2], [1, 1, 3, 2, 1, 1], [4.0, 4.0, 4.0]),
    # servers that do not count steps (HTTP, older records): each delta one step
    ([1, 4, 4, 1], [0, 0, 0, 0], [4.0, 4.0]),
])
def test_decode_steps_are_read_through_merged_deltas(tokens, steps, expected):
    from pdserve.loadgen.calibrate import _decode_step_tokens
    assert _decode_step_tokens([_record(tokens, steps)]) == expected

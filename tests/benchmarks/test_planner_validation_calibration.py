"""benchmarks/planner_validation.py's calibration: what unloaded requests measured beyond the
simulation goes to each request (TTFT) and to each decode step (TPOT), plain and speculative."""
from __future__ import annotations

import dataclasses

import pytest

from pdserve.loadgen.costs import CostProfile, SpeculationCost, StepCost, TransferCost


@pytest.fixture(scope="module")
def validation(load_benchmark):
    return load_benchmark("planner_validation")


def _profile(spec_step: StepCost | None) -> CostProfile:
    return CostProfile("m", "h", prefill=StepCost(0.002, per_token_s=1e-5), decode=StepCost(3e-4, per_seq_s=1e-5),
                       transfer=TransferCost(1000, 1e9), speculation=SpeculationCost(4, 0.8, 0.1, step=spec_step),
                       request_overhead_s=0.001)


def test_the_measured_excess_goes_to_requests_and_decode_steps(validation):
    profile, cal = validation.calibrated(_profile(StepCost(6e-4)), measured_ttft=0.020, simulated_ttft=0.015,
                                         measured_tpot=0.0015, simulated_tpot=0.0004)
    assert profile.request_overhead_s == pytest.approx(0.006)
    assert profile.decode.fixed_s == pytest.approx(3e-4 + 0.0011)
    assert profile.decode.per_seq_s == 1e-5  # only the fixed part moves
    assert profile.speculation.step.fixed_s == pytest.approx(6e-4 + 0.0011)
    assert cal["step_overhead_s"] == pytest.approx(0.0011) and cal["request_overhead_s"] == pytest.approx(0.005)
    # the simulator then predicts the measured unloaded TPOT's extra cost per step
    assert profile.prefill == _profile(None).prefill


def test_a_simulation_slower_than_measured_changes_nothing(validation):
    base = _profile(None)
    profile, cal = validation.calibrated(base, measured_ttft=0.010, simulated_ttft=0.015, measured_tpot=0.0003,
                                         simulated_tpot=0.0004)
    assert profile == dataclasses.replace(base) and cal["step_overhead_s"] == 0 and cal["request_overhead_s"] == 0

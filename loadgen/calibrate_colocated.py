"""A colocated deployment's own calibration (`pdserve calibrate --colocated-only`), on a cost
profile calibrated on a disaggregated one before (`calibrate.calibrated`).

That calibration prices a colocated worker's steps with the disaggregated pair's overheads: its
decode steps with the decode worker's, and each prompt it prefills between them with what a
prompt cost the prefill worker, which relays the first token apart and hands the K/V over. In
the planner validation the colocated workers' TTFT came out 29-33% over the measured and their
TPOT 11-16% under (BENCHMARKS.md, planner validation at d346517). Measured on a colocated
deployment at the same three points, the colocated worker gets steps of its own
(`costs.ColocatedCost`): the same fit as `calibrated`, on the profile with the overheads it fits
set to zero first (the decode step's fixed and per-sequence seconds, each prompt's prefill
seconds, the request's), so each comes back whole, the engine's share and the serving's
together; but the per-sequence and per-prompt overheads found together (`joint_fit`), not in
turn. The per-token and attention costs, which `pdserve profile` measured, stay; nothing the
disaggregated shapes run on changes.
"""
from __future__ import annotations

import dataclasses

from pdserve.loadgen.calibrate import Calibration, Point, calibrated, point, solve
from pdserve.loadgen.costs import ColocatedCost, CostProfile
from pdserve.loadgen.simulator import Shape, SimInput, bench_inputs


def bare(profile: CostProfile) -> CostProfile:
    """The profile with what a colocated calibration fits set to zero: the decode step's fixed
    and per-sequence seconds, each prompt's prefill seconds and the request's overhead."""
    return dataclasses.replace(profile, decode=dataclasses.replace(profile.decode, fixed_s=0.0, per_seq_s=0.0),
                               prefill=dataclasses.replace(profile.prefill, per_seq_s=0.0), request_overhead_s=0.0,
                               speculation=None, colocated=None)


def joint_fit(at, one: float, request: float, loaded: Point, inputs: list[SimInput],
              others: list[tuple[Point, list[SimInput]]], size: int = 17, refinements: int = 3) -> tuple[float, float]:
    """The per-sequence and per-prompt overheads of a colocated worker, together. A prompt's
    overhead slows the decode steps it is prefilled in, so both move TPOT; moved from the
    request's overhead to the prompt's, the same seconds move TTFT only through queueing. Found in
    turn, as `calibrate._fit_loaded` finds a disaggregated pair's, the per-sequence overhead
    takes the prompts' time first, and the prompt's then comes back 0: on a synthetic colocated
    pair whose prompts cost 8 ms, it did, with 0.52 ms a sequence for 0.30. Here, for each prompt
    overhead on a grid over [0, the largest TTFT measured] (refined three times around the best, a step
    either side), the
    per-sequence overhead at which the loaded point's TPOT after the second delta is the measured
    one (`at(per_seq, prompt, inputs)` simulates); of those pairs, the one with the least sum of
    squared relative errors of the loaded point's TTFT and the open loop's (`others`) TPOT and
    TTFT. That pair came back exactly at 8 ms and within 15% at 4 ms (tests); where a prompt costs
    less than the request's own overhead (2 ms against 5), the points hardly tell the two apart,
    and TTFT past the loaded point's rate was over-predicted (scratch: +3% at 100 requests/s,
    +87% at 200 on that synthetic pair). A prompt's overhead may exceed the request's whole
    unloaded excess (`request`; the request's own is then 0 and the unloaded TTFT over-predicted):
    on the planner validation's colocated workers, with the router and the load generator on
    their cores, a prompt cost them more under load than one at a time, and capped there the fit
    put the open loop's TTFT at 15.7 ms against 25.7 measured."""
    def per_seq_at(prompt: float) -> float:
        per_seq = solve(lambda x: at(x, prompt, inputs).steady_tpot_s, loaded.steady_tpot_s)
        if per_seq is None:
            raise ValueError("calibration: the loaded point's simulated steps never hold enough sequences to "
                             f"reach the measured TPOT {loaded.steady_tpot_s:.6f} s: raise the concurrency")
        return per_seq

    def loss(per_seq: float, prompt: float) -> float:
        got = at(per_seq, prompt, inputs)
        out = ((got.ttft_s - loaded.ttft_s) / loaded.ttft_s) ** 2
        for want, where in others:
            got = at(per_seq, prompt, where)
            out += ((got.steady_tpot_s - want.steady_tpot_s) / want.steady_tpot_s) ** 2
            out += ((got.ttft_s - want.ttft_s) / want.ttft_s) ** 2
        return out

    top = max([request, loaded.ttft_s] + [want.ttft_s for want, _ in others])
    low, high, best = 0.0, top, (0.0, 0.0)
    for _ in range(refinements + 1):
        pairs = [(per_seq_at(x), x) for x in (low + (high - low) * j / (size - 1) for j in range(size))]
        best = min(pairs, key=lambda px: loss(*px))
        step = (high - low) / (size - 1)
        low, high, size = max(0.0, best[1] - step), min(top, best[1] + step), 9
    return best


def calibrated_colocated(profile: CostProfile, shape: Shape, unloaded: Point, unloaded_config,
                         loaded: Point | None = None, loaded_inputs: list[SimInput] | None = None,
                         loaded_concurrency: int = 0, opened: Point | None = None,
                         open_inputs: list[SimInput] | None = None,
                         open_rate: float = 0.0) -> tuple[CostProfile, Calibration]:
    """A colocated worker's own steps from a plain colocated deployment's points (`calibrated`'s
    arguments): the unloaded TPOT after the second delta gives a one-sequence decode step, the
    loaded point's how much of it is per sequence, the unloaded TTFT the request's overhead and
    loaded and open-loop points' TTFT and the open loop's TPOT how much of that is each prompt's
    prefill (`joint_fit`). The profile comes back with them as its `colocated` steps; its other costs as they
    were. The Calibration's overheads are these totals (zero-based), `colocated_only` set."""
    if not shape.is_colocated or shape.speculate:
        raise ValueError("calibrating a colocated worker's own steps needs a plain colocated deployment "
                         "(--prefill-workers 0, without --speculation)")
    # "simulated on the profile as given": what it predicted for these requests before this fit
    before = point(profile, shape, bench_inputs(unloaded_config, 0.01), unloaded_config.seed)
    fitted, cal = calibrated(bare(profile), shape, unloaded, unloaded_config, loaded, loaded_inputs, None,
                             loaded_concurrency, opened, open_inputs, open_rate, joint_fit=joint_fit)
    colocated = ColocatedCost(fitted.decode, fitted.prefill, fitted.request_overhead_s)
    notes = dict(profile.notes, colocated_calibration=(
        f"colocated steps measured on a running {shape.label} deployment (pdserve calibrate --colocated-only): "
        f"request {cal.request_overhead_s:.6f} s, decode step {fitted.decode.fixed_s:.6f} s + "
        f"{fitted.decode.per_seq_s:.6f} s a sequence, prefill {fitted.prefill.per_seq_s:.6f} s a prompt"))
    profile = dataclasses.replace(profile, colocated=colocated, notes=notes)
    return profile, dataclasses.replace(cal, simulated_unloaded=before, colocated_only=True)

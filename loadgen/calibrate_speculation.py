"""A speculating deployment's own calibration (`pdserve calibrate --speculation-only`), on a
cost profile calibrated on a plain deployment before (`calibrate.calibrated`).

That calibration gives speculative steps the plain decode step's overheads and prefills with
the draft the plain prompt's. A speculative step streams 2-3 tokens a sequence, and priced so,
the planner validation's 1P:1D +spec TPOT came out 24% under the measured and its TTFT at half
its goodput up to 52% over (BENCHMARKS.md, planner validation). Measured on the speculating
deployment at the same three points as the plain one, its speculative steps get what they cost
beyond the plain steps (fixed and per sequence), and its prefills with the draft a prompt's cost
of their own; nothing else in the profile changes.
"""
from __future__ import annotations

import dataclasses
import math

from pdserve.loadgen.calibrate import LOADED_ROUNDS, Calibration, Point, point, solve, with_acceptance
from pdserve.loadgen.costs import CostProfile
from pdserve.loadgen.simulator import Shape, SimInput, bench_inputs


def with_speculation_overheads(profile: CostProfile, step_s: float = 0.0, per_seq_s: float = 0.0) -> CostProfile:
    """The profile with these overheads added to its measured speculative steps alone (fixed and
    per sequence), the plain decode step's unchanged."""
    spec = profile.speculation
    if spec is None or spec.step is None:
        raise ValueError("calibrating speculation's steps needs a profile whose speculative steps were measured "
                         "(pdserve profile --draft-model)")
    step = dataclasses.replace(spec.step, fixed_s=spec.step.fixed_s + step_s, per_seq_s=spec.step.per_seq_s + per_seq_s)
    return dataclasses.replace(profile, speculation=dataclasses.replace(spec, step=step))


def with_speculation_prefill(profile: CostProfile, per_prompt_s: float) -> CostProfile:
    """The profile with each prompt's cost in a prefill step that fills the draft's cache too
    (`SpeculationCost.prefill`'s per-sequence seconds) set to `per_prompt_s`."""
    spec = profile.speculation
    return dataclasses.replace(profile, speculation=dataclasses.replace(
        spec, prefill=dataclasses.replace(spec.prefill, per_seq_s=per_prompt_s)))


def calibrated_speculation(profile: CostProfile, shape: Shape, unloaded: Point, unloaded_config,
                           loaded: Point | None = None, loaded_inputs: list[SimInput] | None = None,
                           acceptance_rate: float | None = None, loaded_concurrency: int = 0,
                           opened: Point | None = None, open_inputs: list[SimInput] | None = None,
                           open_rate: float = 0.0) -> tuple[CostProfile, Calibration]:
    """Speculation's own calibration, on a profile whose other overheads were calibrated on a
    plain deployment: the points are a speculating deployment's, and only its speculative steps
    and its prefills (which fill the draft's cache too) change. The decode step's overheads,
    added to speculative steps by the plain calibration, are a plain step's: at the planner
    validation's 1P:1D +spec, whose steps stream about 2.7 tokens a sequence, the simulator's
    TPOT came out 24% under the measured. The unloaded TPOT after the second delta gives a
    one-sequence step's excess; the loaded point's, how much of it is per sequence; the
    open-loop point's TTFT (where given, and the profile measured prefills with the draft) each
    prompt's cost in its prefill step, in place of the plain pair's. `acceptance_rate` (the
    deployment's, `acceptance`) replaces the profile's first."""
    if not shape.speculate:
        raise ValueError("calibrating speculation's steps needs a speculating deployment (--speculation)")
    profile = with_speculation_overheads(profile)  # refuses a profile without measured speculative steps
    profile = with_acceptance(profile, acceptance_rate)
    quiet, seed = bench_inputs(unloaded_config, 0.01), unloaded_config.seed
    sim = point(profile, shape, quiet, seed)
    one = solve(lambda x: point(with_speculation_overheads(profile, x), shape, quiet, seed).steady_tpot_s,
                unloaded.steady_tpot_s)
    if one is None:
        raise ValueError("calibration: no speculative step overhead makes the simulated unloaded TPOT the measured "
                         f"{unloaded.steady_tpot_s:.6f} s")
    fits_prefill = opened is not None and profile.speculation.prefill is not None
    prefill = profile.speculation.prefill.per_seq_s if fits_prefill else math.nan

    def at(per_seq: float, where: list[SimInput], prompt: float | None = None) -> Point:
        """The point simulated with these overheads; each prompt's prefill the latest fitted."""
        out = with_speculation_overheads(profile, max(0.0, one - per_seq), per_seq)
        if fits_prefill:
            out = with_speculation_prefill(out, prefill if prompt is None else prompt)
        return point(out, shape, where, seed)

    per_seq, before, after, open_after = 0.0, None, None, None
    for round_ in range(LOADED_ROUNDS if fits_prefill else 1):  # in turn, as `_fit_loaded` does
        if loaded is not None:
            before = before or at(0.0, loaded_inputs)
            per_seq = solve(lambda x: at(x, loaded_inputs).steady_tpot_s, loaded.steady_tpot_s)
            if per_seq is None:
                raise ValueError("calibration: the loaded point's simulated steps never hold enough sequences to "
                                 f"reach the measured TPOT {loaded.steady_tpot_s:.6f} s: raise the concurrency")
        if fits_prefill and round_ < LOADED_ROUNDS - 1:
            found = solve(lambda y: at(per_seq, open_inputs, y).ttft_s, opened.ttft_s)
            prefill = prefill if found is None else found
    if loaded is not None:
        after = at(per_seq, loaded_inputs)
    if fits_prefill:
        open_after = at(per_seq, open_inputs)
    step = max(0.0, one - per_seq)
    profile = with_speculation_overheads(profile, step, per_seq)
    if fits_prefill:
        profile = with_speculation_prefill(profile, prefill)
    notes = dict(profile.notes, speculation_calibration=f"speculative steps' overheads measured on a running "
                 f"{shape.label} deployment (pdserve calibrate --speculation-only): {step:.6f} s + {per_seq:.6f} s "
                 "a sequence, beyond the decode step's" + ("" if not fits_prefill else
                                                           f"; each prompt's prefill with the draft {prefill:.6f} s"))
    profile = dataclasses.replace(profile, notes=notes)
    return profile, Calibration(unloaded, sim, 0.0, 0.0, 0.0, 0.0, 0.0, loaded_concurrency, loaded, before, after,
                                math.nan if acceptance_rate is None else acceptance_rate,
                                *((open_rate, opened, open_after) if open_after is not None else (0.0, None, None)),
                                speculation_only=True, spec_step_overhead_s=step, spec_per_seq_overhead_s=per_seq,
                                spec_prefill_s=prefill)

"""Calibrating a cost profile on a running deployment (`pdserve calibrate`).

`pdserve profile` times the engine's steps alone. A served request also pays what the profile
never sees: the router (parsing, tokenizing, admission, the gRPC calls to both workers) and, on
every decode step, the serving loop (each sequence's token delta streamed to the router and on
to the client, detokenized on the way). Measured against a 1P:1D pair of the demo model, that
was most of a served token (BENCHMARKS.md, planner validation): unloaded, the simulator on the
engine's profile alone predicted a TPOT of 0.9 ms where the pair measured 1.4, and under load the
gap grew with the batch, as a per-sequence cost does.

Two measured points on the running deployment, each beside the simulator's prediction for the
same requests (the same lengths; unloaded ones far apart, loaded ones at the times they were
sent), set four overheads of the profile:

    unloaded (one request at a time): TPOT              -> the overhead of a step of one sequence
                                      TTFT              -> request_overhead_s (each request)
    loaded (`concurrency` requests in flight, each sent as another ends; replayed at those times):
                                      TPOT              -> how much of that is per sequence
                                                           (decode.per_seq_s; the rest: decode.fixed_s)
                                      TTFT              -> prefill.per_seq_s (each prompt's serving on
                                                           the prefill side: what queues prompts under load)

each the value at which the simulator predicts what was measured (bisection: TPOT and TTFT grow
with every overhead). The per-sequence and per-prompt overheads come out of the unloaded
excesses, which paid them once: where the loaded point asks more than that, the rest is 0 and the
unloaded point is over-predicted (the loaded point, nearer where goodput is decided, wins).

Speculative steps measured as a whole (`SpeculationCost.step`) get the same two step overheads,
and a draft's prefill steps the prompt's. A speculating deployment's acceptance rate is measured
too, from the tokens its unloaded decode steps stream (`acceptance`): `pdserve profile` measures
it on its own prompts, and on the planner validation's requests the demo pair accepted far less
(per-position α about 0.6 against the profile's 0.73). An excess that is negative (the simulation already
slower) changes nothing. What is left out: any cost that grows with prompt length beyond the
profile's, and an overhead that is not the workers' (the router's, or a load generator's on the
same cores) except as the time it adds.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pdserve.loadgen.costs import CostProfile, StepCost, acceptance_from_tokens_per_step
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.simulator import Shape, SimInput, bench_inputs, simulate
from pdserve.loadgen.stats import SLO, RunSummary, summarize

BISECTION_STEPS = 24  # each overhead to ~1e-7 of its bracket
MAX_DOUBLINGS = 20
LOADED_ROUNDS = 3  # of the two loaded solves in turn (the per-sequence one once more at the end)


@dataclass(frozen=True, slots=True)
class Calibration:
    """What was measured and simulated at both points, and the overheads that follow (seconds)."""

    measured_unloaded_ttft_s: float
    simulated_unloaded_ttft_s: float
    measured_unloaded_tpot_s: float
    simulated_unloaded_tpot_s: float
    loaded_concurrency: int  # requests in flight at the loaded point (0: none measured)
    measured_loaded_tpot_s: float
    simulated_loaded_tpot_s: float  # with the unloaded overheads only
    measured_loaded_ttft_s: float
    simulated_loaded_ttft_s: float  # the same
    request_overhead_s: float
    step_overhead_s: float
    per_seq_overhead_s: float
    prefill_overhead_s: float  # per request prefilled, in the step that prefills it
    acceptance_rate: float = math.nan  # a speculating deployment's α, from its unloaded deltas (nan: none)
    calibrated_loaded_tpot_s: float = math.nan  # the loaded point as the calibrated profile predicts it
    calibrated_loaded_ttft_s: float = math.nan

    def describe(self) -> str:
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        return (f"per request {ms(self.request_overhead_s)} (unloaded TTFT measured {ms(self.measured_unloaded_ttft_s)}, "
                f"simulated {ms(self.simulated_unloaded_ttft_s)}); per decode step {ms(self.step_overhead_s)} "
                f"(unloaded TPOT measured {ms(self.measured_unloaded_tpot_s)}, simulated "
                f"{ms(self.simulated_unloaded_tpot_s)}); per sequence of a decode step {ms(self.per_seq_overhead_s)} "
                f"(TPOT with {self.loaded_concurrency} requests in flight measured {ms(self.measured_loaded_tpot_s)}, "
                f"simulated {ms(self.simulated_loaded_tpot_s)} before, {ms(self.calibrated_loaded_tpot_s)} after); "
                f"per prompt prefilled {ms(self.prefill_overhead_s)} (TTFT there measured "
                f"{ms(self.measured_loaded_ttft_s)}, simulated {ms(self.simulated_loaded_ttft_s)} before, "
                f"{ms(self.calibrated_loaded_ttft_s)} after)" + ("" if math.isnan(self.acceptance_rate) else
                                 f"; speculation's acceptance rate {self.acceptance_rate:.3f}"))


def with_overheads(profile: CostProfile, request_s: float = 0.0, step_s: float = 0.0, per_seq_s: float = 0.0,
                   prefill_s: float = 0.0) -> CostProfile:
    """The profile with these overheads added: to each request; to each decode step (fixed and
    per sequence), plain or speculative (where speculative steps are measured whole); and to each
    prefill step per sequence it prefills (a draft's prefill too)."""
    def add(cost: StepCost, fixed: float, per_seq: float) -> StepCost:
        return dataclasses.replace(cost, fixed_s=cost.fixed_s + fixed, per_seq_s=cost.per_seq_s + per_seq)

    spec = profile.speculation
    if spec is not None:
        spec = dataclasses.replace(spec, step=spec.step and add(spec.step, step_s, per_seq_s),
                                   prefill=spec.prefill and add(spec.prefill, 0.0, prefill_s))
    return dataclasses.replace(profile, request_overhead_s=profile.request_overhead_s + request_s,
                               decode=add(profile.decode, step_s, per_seq_s),
                               prefill=add(profile.prefill, 0.0, prefill_s), speculation=spec)


def predict(profile: CostProfile, shape: Shape, config, rate: float) -> RunSummary:
    """The simulator's summary of the requests `pdserve bench` sends at `rate` for `config`."""
    return replay(profile, shape, bench_inputs(config, rate), config.seed, rate, config.slo)


def replay(profile: CostProfile, shape: Shape, inputs: list[SimInput], seed: int = 0, rate: float = math.nan,
           slo: SLO = SLO()) -> RunSummary:
    """The simulator's summary of these requests (arrival times and lengths)."""
    return summarize(simulate(profile, shape, inputs, seed).records, rate, slo)


def sent_inputs(config, records: list[RequestRecord]) -> list[SimInput]:
    """The requests of a measured run as the simulator takes them: each sent when it was (a run
    capped at some concurrency sends a request as one finishes, so its arrivals are the system's
    own pace) with its lengths (`bench_inputs`' for the same config)."""
    lengths = bench_inputs(config, 1.0)
    return [SimInput(r.sent_s, lengths[r.index].prompt_len, lengths[r.index].output_len)
            for r in sorted(records, key=lambda r: r.sent_s) if r.sent_s is not None]


def solve(f, target: float) -> float | None:
    """The x >= 0 where f, increasing, reaches `target`: 0 when f(0) already does; else a bracket
    doubled from `target` up (a speculative step's overhead is several times its TPOT's share)
    and bisected; None when no bracket reaches it."""
    low, high = 0.0, max(target, 1e-9)
    if f(low) >= target:
        return 0.0
    for _ in range(MAX_DOUBLINGS):
        if f(high) >= target:
            break
        low, high = high, 2 * high
    else:
        return None
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < target else (low, mid)
    # the simulated median can jump where an overhead reorders events (a request admitted a step
    # earlier or later): of the two ends, the one that predicts the target more closely
    return low if target - f(low) < f(high) - target else high


def calibrated(profile: CostProfile, shape: Shape, unloaded: RunSummary, unloaded_config,
               loaded: RunSummary | None = None, loaded_inputs: list[SimInput] | None = None,
               acceptance_rate: float | None = None, loaded_concurrency: int = 0) -> tuple[CostProfile, Calibration]:
    """The calibration from measured summaries: `unloaded`, of the requests `unloaded_config`
    sends one at a time; `loaded` (or None), of `loaded_inputs` (as `sent_inputs` replays them).
    `acceptance_rate`, where given, replaces the profile's speculation α first (`acceptance`).

    Each overhead is found on the simulator, as the value at which it predicts what was measured
    (a speculative step's overhead spreads over the tokens it emits, so a TPOT's excess is not
    a step's): the overhead of a step of one sequence from the unloaded TPOT; then the request's
    from the unloaded TTFT; then, under load, how much of the one-sequence step's overhead is
    per sequence (the rest is the step's fixed part) and how much of the request's is each
    prompt's prefill."""
    if acceptance_rate is not None and profile.speculation is not None:
        profile = dataclasses.replace(profile, speculation=dataclasses.replace(profile.speculation,
                                                                               acceptance_rate=acceptance_rate))
    # the unloaded requests far apart, their workload built once (every solve's step simulates them)
    quiet = bench_inputs(unloaded_config, 0.01)
    sim = replay(profile, shape, quiet, unloaded_config.seed)
    one = solve(lambda x: replay(with_overheads(profile, step_s=x), shape, quiet, unloaded_config.seed).tpot.p50,
                unloaded.tpot.p50)
    if one is None:
        raise ValueError("calibration: no step overhead makes the simulated unloaded TPOT the measured "
                         f"{unloaded.tpot.p50:.6f} s: is the profile for this deployment (--speculation)?")
    stepped = with_overheads(profile, step_s=one)
    request = max(0.0, unloaded.ttft.p50 - replay(stepped, shape, quiet, unloaded_config.seed).ttft.p50)
    loaded_fit = _LoadedFit()
    if loaded is not None:
        loaded_fit = _fit_loaded(profile, shape, loaded, loaded_inputs, unloaded_config.seed, request, one)
    per_seq, prefill, after = loaded_fit.per_seq, loaded_fit.prefill, loaded_fit.after
    step, request = max(0.0, one - per_seq), max(0.0, request - prefill)
    profile = with_overheads(profile, request, step, per_seq, prefill)
    notes = dict(profile.notes, calibration=f"overheads measured on a running {shape.label} deployment "
                 f"(pdserve calibrate): request {request:.6f} s, decode step {step:.6f} s + {per_seq:.6f} s a sequence, "
                 f"prefill {prefill:.6f} s a prompt")
    profile = dataclasses.replace(profile, notes=notes)
    measured = (loaded.tpot.p50, loaded.ttft.p50) if loaded is not None else (math.nan, math.nan)
    before = (loaded_fit.before.tpot.p50, loaded_fit.before.ttft.p50) if loaded_fit.before else (math.nan, math.nan)
    return profile, Calibration(unloaded.ttft.p50, sim.ttft.p50, unloaded.tpot.p50, sim.tpot.p50, loaded_concurrency,
                                measured[0], before[0], measured[1], before[1], request, step, per_seq, prefill,
                                math.nan if acceptance_rate is None else acceptance_rate,
                                after.tpot.p50 if after else math.nan, after.ttft.p50 if after else math.nan)


@dataclass(slots=True)
class _LoadedFit:
    per_seq: float = 0.0
    prefill: float = 0.0
    before: RunSummary | None = None  # the loaded point predicted with the unloaded overheads only
    after: RunSummary | None = None  # and calibrated


def _fit_loaded(profile: CostProfile, shape: Shape, loaded: RunSummary, inputs: list[SimInput], seed: int,
                request: float, one: float) -> _LoadedFit:
    """The per-sequence and per-prompt overheads, out of the unloaded request's (`request`) and
    one-sequence step's (`one`) excesses, at which the replayed loaded requests' TPOT and TTFT
    are the measured ones. TPOT under load gives the per-sequence overhead; TTFT under load what
    each prompt's serving on the prefill side costs (its K/V handed over, its stream), as time
    its prefill step takes. Each moves the other (colocated, a prompt's prefill runs inside a
    decode step), so they are found in turn, the per-sequence one last."""
    def at_load(per_seq: float, prefill: float) -> RunSummary:
        return replay(with_overheads(profile, max(0.0, request - prefill), max(0.0, one - per_seq), per_seq, prefill),
                      shape, inputs, seed)

    fit = _LoadedFit(before=at_load(0.0, 0.0))
    for round_ in range(LOADED_ROUNDS):
        per_seq = solve(lambda x: at_load(x, fit.prefill).tpot.p50, loaded.tpot.p50)
        if per_seq is None:
            raise ValueError("calibration: the loaded point's simulated steps never hold enough sequences to "
                             f"reach the measured TPOT {loaded.tpot.p50:.6f} s: raise the concurrency")
        fit.per_seq = per_seq
        if round_ < LOADED_ROUNDS - 1:
            fit.prefill = solve(lambda x: at_load(fit.per_seq, x).ttft.p50, loaded.ttft.p50) or 0.0
    fit.after = at_load(fit.per_seq, fit.prefill)
    return fit


def acceptance(records: list[RequestRecord], k: int) -> float | None:
    """A speculating deployment's acceptance rate α, from the deltas of requests served one at a
    time: each decode step streams one delta a sequence, so the deltas between the first (the
    prefill's token) and the last (a step cut short by max_tokens, which counted made a
    self-drafting pair that accepts everything read 0.94) carry a step's tokens, whose mean gives
    α at depth k as `pdserve profile` solves it. None when no request had such a delta. The
    deployment must draft at that fixed depth (`--no-spec-adaptive`): with adaptive depth a step
    streams the tokens of the depth it chose, and α reads low (0.24 on `pdserve serve`'s demo
    pair, whose default depth adapts)."""
    steps = [n for r in records if r.is_ok for n in r.delta_tokens[1:-1]]
    return acceptance_from_tokens_per_step(sum(steps) / len(steps), k) if steps else None


def calibrate(profile: CostProfile, shape: Shape, config, num_requests: int = 16, concurrency: int = 8,
              loaded_requests: int | None = None, progress: bool = False) -> tuple[CostProfile, Calibration]:
    """Measure both points on the deployment `config` targets (a `BenchConfig`: its workload,
    sampling and seed; its rates are ignored) and calibrate the profile: `num_requests` one at a
    time, then `loaded_requests` (default 4 x concurrency) with `concurrency` in flight, each sent
    as another ends (0: no loaded point). Replayed in the simulator at the times they were sent,
    the loaded requests meet the load they met: an open-loop rate picked beforehand overloaded
    the demo pair or left it idle, and its TPOT then said more about the queue than the steps."""
    from pdserve.loadgen.bench import run_bench

    if num_requests < 2:
        raise ValueError(f"calibrating needs at least 2 requests per point, got {num_requests}")
    if concurrency < 0 or concurrency == 1:
        raise ValueError(f"concurrency must be 0 (unloaded only) or at least 2, got {concurrency}")
    unloaded_config = dataclasses.replace(config, rates=(math.inf,), num_requests=num_requests, max_concurrency=1,
                                          duration_s=None, search=None)
    one_at_a_time = run_bench(unloaded_config, progress=progress)
    (unloaded,) = one_at_a_time.summaries()
    _check_measured(unloaded, "unloaded")
    alpha = None
    if shape.speculate:  # the deployment's own α: the profile's was measured on its own prompts
        alpha = acceptance(one_at_a_time.runs[0].records, profile.speculation.num_speculative_tokens)
    loaded, inputs = None, None
    if concurrency:
        loaded_config = dataclasses.replace(unloaded_config, max_concurrency=concurrency,
                                            num_requests=loaded_requests or 4 * concurrency)
        busy = run_bench(loaded_config, progress=progress)
        (loaded,) = busy.summaries()
        _check_measured(loaded, f"loaded ({concurrency} in flight)")
        inputs = sent_inputs(loaded_config, busy.runs[0].records)
    return calibrated(profile, shape, unloaded, unloaded_config, loaded, inputs, alpha, concurrency)


def _check_measured(summary: RunSummary, what: str) -> None:
    if summary.num_ok < summary.num_requests:
        raise ValueError(f"calibration: {summary.num_requests - summary.num_ok} of {summary.num_requests} {what} "
                         f"requests failed ({summary.failures}): the deployment must serve them all")
    if summary.tpot is None:
        raise ValueError("calibration: no request had a second token, so there is no TPOT to measure: "
                         "use outputs of 2 tokens or more (--output-len)")

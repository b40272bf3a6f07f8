"""Calibrating a cost profile on a running deployment (`pdserve calibrate`).

`pdserve profile` times the engine's steps alone. A served request also pays what the profile
never sees: the router (parsing, tokenizing, admission, the gRPC calls to both workers) and, on
every decode step, the serving loop (each sequence's token delta streamed to the router and on
to the client, detokenized on the way). Measured against a 1P:1D pair of the demo model, that
was most of a served token (BENCHMARKS.md, planner validation): unloaded, the simulator on the
engine's profile alone predicted a TPOT of 0.9 ms where the pair measured 1.4, and under load the
gap grew with the batch, as a per-sequence cost does.

Three measured points on the running deployment, each beside the simulator's prediction for
the same requests (the same lengths; unloaded ones far apart, loaded ones at the times they were
sent), set five overheads of the profile. A request's TPOT is split in two there: the gap from
its first delta (the token the prefill worker sampled) to its second (the decode worker's first
step, once the K/V came), and the time per token after that (`Point`). Fitted on TPOT whole,
a hand-over the simulator made too short was paid for by steps it made too cheap, and under
open-loop load the 1P:1D pair's median TPOT came out 22-24% under the measured (2-11% split;
BENCHMARKS.md, planner validation):

    unloaded (one request at a time): TPOT after the 2nd delta -> the overhead of a step of one sequence
                                      1st to 2nd delta   -> each prompt's hand-over (disaggregated:
                                                            transfer.latency_s, a prefill worker's
                                                            transfers one after another)
                                      TTFT               -> request_overhead_s (each request)
    loaded (`concurrency` requests in flight, each sent as another ends; replayed at those times):
                                      TPOT after the 2nd delta -> how much of that is per sequence
                                                            (decode.per_seq_s; the rest: decode.fixed_s)
    open loop (as many requests again, Poisson arrivals at OPEN_FRACTION of the closed loop's
    measured request throughput; replayed at those times):
                                      TTFT               -> prefill.per_seq_s (each prompt's serving on
                                                            the prefill side: what queues prompts under load)

each the value at which the simulator predicts what was measured (bisection: each grows with
its overhead). The prompt's overhead came from the closed loop's TTFT before: eight in flight
run the pair at its capacity, prompts queueing behind each other's prefills, and so fitted it
over-predicted TTFT at the open-loop rates a deployment is sized for by 23-51% (BENCHMARKS.md,
planner validation at f4e9d5c). At 0.6 of the closed loop's throughput the fit under-predicted
the 1P:1D pair's TTFT at 0.8 of its goodput by 19%, and its goodput came out 15-19% high; at
0.75, nearer where goodput is decided, every configuration's goodput came within 11% in one run
and 9-15% under at the median in the next. The per-sequence and per-prompt overheads come out
of the unloaded excesses, which paid them once: where the loaded points ask more than that, the
rest is 0 and the unloaded point is over-predicted (the loaded points, nearer where goodput is
decided, win).

Speculative steps measured as a whole (`SpeculationCost.step`) get the same two step overheads,
and a draft's prefill steps the prompt's. Calibrated on a speculating deployment with
`speculation_only` (`pdserve calibrate --speculation-only`), a profile calibrated on a plain one
keeps those; its speculative steps get what they cost beyond them, and its prefills with the
draft a prompt's cost of their own (`calibrate_speculation.py`). A speculative step streams 2-3
tokens a sequence, and priced with the plain pair's overheads the planner validation's 1P:1D
+spec TPOT came out 24% under the measured. Likewise `colocated_only` (`pdserve calibrate
--colocated-only`, `calibrate_colocated.py`) gives a colocated worker steps of its own, which
the colocated shapes run on: priced with the 1P:1D pair's overheads, the validation's colocated
TTFT came out 29-33% over. A speculating deployment's acceptance rate is
measured too, from the tokens its unloaded decode steps stream (`acceptance`): `pdserve profile`
measures it on its own prompts, and on the planner validation's requests the demo pair accepted
far less (per-position α about 0.6 against the profile's 0.73). An excess that is negative (the
simulation already slower) changes nothing. What is left out: any cost that grows with prompt length beyond the
profile's, and an overhead that is not the workers' (the router's, or a load generator's on the
same cores) except as the time it adds.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from pdserve.loadgen.costs import CostProfile, StepCost, acceptance_from_tokens_per_step
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.simulator import Shape, SimInput, bench_inputs, simulate
from pdserve.loadgen.stats import RunSummary, summarize

BISECTION_STEPS = 24  # each overhead to ~1e-7 of its bracket
MAX_DOUBLINGS = 20
LOADED_ROUNDS = 3  # of the two loaded solves in turn (the per-sequence one once more at the end)
SPECULATING_TOKENS_PER_STEP = 1.2  # a plain deployment streams exactly 1 a decode step (a speculating one 2-5)
OPEN_FRACTION = 0.75  # the open-loop point's rate, of the closed loop's measured request throughput


@dataclass(frozen=True, slots=True)
class Point:
    """The medians calibration compares, over one run's requests (measured or simulated) that
    streamed at least three deltas."""

    ttft_s: float
    tpot_s: float
    steady_tpot_s: float  # per token after the second delta: the decode steps alone
    first_gap_s: float  # first delta to second: the K/V hand-over, then a decode step

    @classmethod
    def of(cls, records: list[RequestRecord]) -> "Point":
        ok = [r for r in records if r.is_ok and len(r.delta_times_s) >= 3]
        if not ok:
            raise ValueError("calibration: no request streamed three deltas (its first token and two decode "
                             "steps): use longer outputs (--output-len)")
        med = statistics.median
        return cls(med(r.ttft_s for r in ok), med(r.tpot_s for r in ok),
                   med((r.delta_times_s[-1] - r.delta_times_s[1]) / sum(r.delta_tokens[2:]) for r in ok),
                   med(r.delta_times_s[1] - r.delta_times_s[0] for r in ok))

    def describe(self) -> str:
        return (f"TTFT {self.ttft_s * 1e3:.2f} ms, TPOT {self.tpot_s * 1e3:.2f} ms (after the second delta "
                f"{self.steady_tpot_s * 1e3:.2f} ms; first to second delta {self.first_gap_s * 1e3:.2f} ms)")


@dataclass(frozen=True, slots=True)
class Calibration:
    """What was measured and simulated at both points, and the overheads that follow (seconds)."""

    measured_unloaded: Point
    simulated_unloaded: Point  # the profile as given
    request_overhead_s: float
    step_overhead_s: float
    per_seq_overhead_s: float
    prefill_overhead_s: float  # per request prefilled, in the step that prefills it
    handover_s: float = 0.0  # per prompt handed over by a prefill worker (disaggregated), one after another
    loaded_concurrency: int = 0  # requests in flight at the loaded point (0: none measured)
    measured_loaded: Point | None = None
    simulated_loaded: Point | None = None  # with the unloaded overheads only
    calibrated_loaded: Point | None = None  # with all of them
    acceptance_rate: float = math.nan  # a speculating deployment's α, from its unloaded deltas (nan: none)
    open_rate: float = 0.0  # requests/s of the open-loop point (0: none measured)
    measured_open: Point | None = None
    calibrated_open: Point | None = None
    speculation_only: bool = False  # only speculative steps' overheads, on a profile calibrated before
    spec_step_overhead_s: float = 0.0  # added to speculative steps alone, beyond the decode step's
    spec_per_seq_overhead_s: float = 0.0
    spec_prefill_s: float = math.nan  # each prompt's cost in a prefill with the draft, fitted (nan: kept)
    colocated_only: bool = False  # a colocated worker's own steps: the overheads above are their totals

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Calibration":
        points = {k: None if obj.get(k) is None else Point(**obj[k])
                  for k in ("measured_unloaded", "simulated_unloaded", "measured_loaded", "simulated_loaded",
                            "calibrated_loaded", "measured_open", "calibrated_open")}
        return cls(**{**obj, **points})

    def describe(self) -> str:
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        lines = [f"unloaded: measured {self.measured_unloaded.describe()}; simulated on the profile as given "
                 f"{self.simulated_unloaded.describe()}"]
        if self.measured_loaded is not None:
            lines.append(f"{self.loaded_concurrency} in flight: measured {self.measured_loaded.describe()}; "
                         f"simulated with the unloaded overheads {self.simulated_loaded.describe()}; calibrated "
                         f"{self.calibrated_loaded.describe()}")
        if self.measured_open is not None:
            lines.append(f"open loop at {self.open_rate:.2f} requests/s: measured {self.measured_open.describe()}; "
                         f"calibrated {self.calibrated_open.describe()}")
        if self.colocated_only:
            lines.append(f"a colocated worker's own steps (the engine's seconds and the serving's together): per "
                         f"request {ms(self.request_overhead_s)}; per decode step {ms(self.step_overhead_s)} + "
                         f"{ms(self.per_seq_overhead_s)} a sequence; per prompt prefilled {ms(self.prefill_overhead_s)}")
            return "\n".join(lines)
        if self.speculation_only:
            lines.append(f"overheads of a speculative step beyond the profile's: {ms(self.spec_step_overhead_s)} + "
                         f"{ms(self.spec_per_seq_overhead_s)} a sequence"
                         + ("" if math.isnan(self.spec_prefill_s) else
                            f"; each prompt in a prefill with the draft {ms(self.spec_prefill_s)}")
                         + ("" if math.isnan(self.acceptance_rate) else
                            f"; speculation's acceptance rate {self.acceptance_rate:.3f}"))
            return "\n".join(lines)
        lines.append(f"overheads: per request {ms(self.request_overhead_s)}; per decode step "
                     f"{ms(self.step_overhead_s)} + {ms(self.per_seq_overhead_s)} a sequence; per prompt prefilled "
                     f"{ms(self.prefill_overhead_s)}; per prompt handed over {ms(self.handover_s)}"
                     + ("" if math.isnan(self.acceptance_rate) else
                        f"; speculation's acceptance rate {self.acceptance_rate:.3f}"))
        return "\n".join(lines)


def with_overheads(profile: CostProfile, request_s: float = 0.0, step_s: float = 0.0, per_seq_s: float = 0.0,
                   prefill_s: float = 0.0, handover_s: float = 0.0) -> CostProfile:
    """The profile with these overheads added: to each request; to each decode step (fixed and
    per sequence), plain or speculative (where speculative steps are measured whole); to each
    prefill step per sequence it prefills (a draft's prefill too); and to each prompt's K/V
    transfer (its latency, which a prefill worker's transfers pay one after another)."""
    def add(cost: StepCost, fixed: float, per_seq: float) -> StepCost:
        return dataclasses.replace(cost, fixed_s=cost.fixed_s + fixed, per_seq_s=cost.per_seq_s + per_seq)

    spec = profile.speculation
    if spec is not None:
        spec = dataclasses.replace(spec, step=spec.step and add(spec.step, step_s, per_seq_s),
                                   prefill=spec.prefill and add(spec.prefill, 0.0, prefill_s))
    transfer = dataclasses.replace(profile.transfer, latency_s=profile.transfer.latency_s + handover_s)
    return dataclasses.replace(profile, request_overhead_s=profile.request_overhead_s + request_s,
                               decode=add(profile.decode, step_s, per_seq_s),
                               prefill=add(profile.prefill, 0.0, prefill_s), speculation=spec, transfer=transfer)


def with_acceptance(profile: CostProfile, acceptance_rate: float | None) -> CostProfile:
    """The profile with its speculation's α replaced, where both are given (a deployment's own,
    `acceptance`)."""
    if acceptance_rate is None or profile.speculation is None:
        return profile
    return dataclasses.replace(profile, speculation=dataclasses.replace(profile.speculation,
                                                                        acceptance_rate=acceptance_rate))


def predict(profile: CostProfile, shape: Shape, config, rate: float) -> RunSummary:
    """The simulator's summary of the requests `pdserve bench` sends at `rate` for `config`."""
    return summarize(simulate(profile, shape, bench_inputs(config, rate), config.seed).records, rate, config.slo)


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


def point(profile: CostProfile, shape: Shape, inputs: list[SimInput], seed: int = 0) -> Point:
    """The simulator's `Point` for these requests."""
    return Point.of(simulate(profile, shape, inputs, seed).records)


def calibrated(profile: CostProfile, shape: Shape, unloaded: Point, unloaded_config,
               loaded: Point | None = None, loaded_inputs: list[SimInput] | None = None,
               acceptance_rate: float | None = None, loaded_concurrency: int = 0,
               opened: Point | None = None, open_inputs: list[SimInput] | None = None,
               open_rate: float = 0.0, joint_fit=None) -> tuple[CostProfile, Calibration]:
    """The calibration from measured points: `unloaded`, of the requests `unloaded_config` sends
    one at a time; `loaded` (or None), of `loaded_inputs` (as `sent_inputs` replays them);
    `opened` (or None), of `open_inputs`, arrivals at `open_rate` whatever the system's pace,
    which then sets each prompt's prefill overhead in the loaded point's place (`calibrate`).
    `acceptance_rate`, where given, replaces the profile's speculation α first (`acceptance`).

    Each overhead is found on the simulator, as the value at which it predicts what was measured
    (a speculative step's overhead spreads over the tokens it emits, so a TPOT's excess is not
    a step's): the overhead of a step of one sequence from the unloaded TPOT after the second
    delta; disaggregated, each prompt's hand-over from the unloaded gap between the first delta
    (the prefill worker's token) and the second (the decode worker's first step, after the K/V
    came); the request's from the unloaded TTFT; then, under load, how much of the one-sequence
    step's overhead is per sequence (the rest is the step's fixed part) and how much of the
    request's is each prompt's prefill. `joint_fit`, where given, finds the per-sequence and
    per-prompt overheads in place of the solves in turn (`_fit_loaded`)."""
    profile = with_acceptance(profile, acceptance_rate)
    # the unloaded requests far apart, their workload built once (every solve's step simulates them)
    quiet, seed = bench_inputs(unloaded_config, 0.01), unloaded_config.seed
    sim = point(profile, shape, quiet, seed)
    one = solve(lambda x: point(with_overheads(profile, step_s=x), shape, quiet, seed).steady_tpot_s,
                unloaded.steady_tpot_s)
    if one is None:
        raise ValueError("calibration: no step overhead makes the simulated unloaded TPOT the measured "
                         f"{unloaded.steady_tpot_s:.6f} s: is the profile for this deployment (--speculation)?")
    handover = 0.0
    if not shape.is_colocated:
        handover = solve(lambda x: point(with_overheads(profile, step_s=one, handover_s=x), shape, quiet,
                                         seed).first_gap_s, unloaded.first_gap_s) or 0.0
    stepped = with_overheads(profile, step_s=one, handover_s=handover)
    request = max(0.0, unloaded.ttft_s - point(stepped, shape, quiet, seed).ttft_s)
    fit = _LoadedFit()
    if loaded is not None:
        fit = _fit_loaded(profile, shape, loaded, loaded_inputs, seed, request, one, handover, opened, open_inputs,
                          joint_fit)
    step, request = max(0.0, one - fit.per_seq), max(0.0, request - fit.prefill)
    profile = with_overheads(profile, request, step, fit.per_seq, fit.prefill, handover)
    notes = dict(profile.notes, calibration=f"overheads measured on a running {shape.label} deployment "
                 f"(pdserve calibrate): request {request:.6f} s, decode step {step:.6f} s + {fit.per_seq:.6f} s a "
                 f"sequence, prefill {fit.prefill:.6f} s a prompt, hand-over {handover:.6f} s a prompt")
    profile = dataclasses.replace(profile, notes=notes)
    return profile, Calibration(unloaded, sim, request, step, fit.per_seq, fit.prefill, handover, loaded_concurrency,
                                loaded, fit.before, fit.after,
                                math.nan if acceptance_rate is None else acceptance_rate,
                                *((open_rate, opened, fit.open_after) if fit.open_after is not None else ()))


@dataclass(slots=True)
class _LoadedFit:
    per_seq: float = 0.0
    prefill: float = 0.0
    before: Point | None = None  # the loaded point predicted with the unloaded overheads only
    after: Point | None = None  # and calibrated
    open_after: Point | None = None  # the open-loop point, calibrated


def _fit_loaded(profile: CostProfile, shape: Shape, loaded: Point, inputs: list[SimInput], seed: int,
                request: float, one: float, handover: float, opened: Point | None = None,
                open_inputs: list[SimInput] | None = None, joint_fit=None) -> _LoadedFit:
    """The per-sequence and per-prompt overheads, out of the unloaded request's (`request`) and
    one-sequence step's (`one`) excesses, at which the replayed loaded requests' TPOT after the
    second delta and TTFT are the measured ones. The first gives the per-sequence overhead; TTFT
    under load what each prompt's serving on the prefill side costs (its stream, its K/V sent),
    as time its prefill step takes: the open-loop point's TTFT where one was measured, else the
    loaded point's. Each moves the other (colocated, a prompt's prefill runs inside a decode
    step), so they are found in turn, the per-sequence one last; or by `joint_fit(at, one, request,
    loaded, inputs, others)`, others the open-loop point's (point, inputs) if any."""
    def at(per_seq: float, prefill: float, where: list[SimInput]) -> Point:
        return point(with_overheads(profile, max(0.0, request - prefill), max(0.0, one - per_seq), per_seq, prefill,
                                    handover), shape, where, seed)

    fit = _LoadedFit(before=at(0.0, 0.0, inputs))
    if joint_fit is not None:
        others = [] if opened is None else [(opened, open_inputs)]
        fit.per_seq, fit.prefill = joint_fit(at, one, request, loaded, inputs, others)
        fit.after = at(fit.per_seq, fit.prefill, inputs)
        fit.open_after = None if opened is None else at(fit.per_seq, fit.prefill, open_inputs)
        return fit
    ttft_point, ttft_inputs = (loaded, inputs) if opened is None else (opened, open_inputs)
    for round_ in range(LOADED_ROUNDS):
        per_seq = solve(lambda x: at(x, fit.prefill, inputs).steady_tpot_s, loaded.steady_tpot_s)
        if per_seq is None:
            raise ValueError("calibration: the loaded point's simulated steps never hold enough sequences to "
                             f"reach the measured TPOT {loaded.steady_tpot_s:.6f} s: raise the concurrency")
        fit.per_seq = per_seq
        if round_ < LOADED_ROUNDS - 1:
            fit.prefill = solve(lambda x: at(fit.per_seq, x, ttft_inputs).ttft_s, ttft_point.ttft_s) or 0.0
    fit.after = at(fit.per_seq, fit.prefill, inputs)
    if opened is not None:
        fit.open_after = at(fit.per_seq, fit.prefill, open_inputs)
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
    steps = _decode_step_tokens(records)
    return acceptance_from_tokens_per_step(sum(steps) / len(steps), k) if steps else None


def calibrate(profile: CostProfile, shape: Shape, config, num_requests: int = 16, concurrency: int = 8,
              loaded_requests: int | None = None, progress: bool = False, open_fraction: float = OPEN_FRACTION,
              speculation_only: bool = False, colocated_only: bool = False) -> tuple[CostProfile, Calibration]:
    """Measure the points on the deployment `config` targets (a `BenchConfig`: its workload,
    sampling and seed; its rates are ignored) and calibrate the profile: `num_requests` one at a
    time, then `loaded_requests` (default 4 x concurrency) with `concurrency` in flight, each sent
    as another ends (0: no loaded point), then as many again arriving open loop (Poisson) at
    `open_fraction` of the request throughput that closed loop measured (0: none).

    Replayed in the simulator at the times they were sent, the closed loop's requests meet the
    load they met: an open-loop rate picked beforehand overloaded the demo pair or left it idle,
    and its TPOT then said more about the queue than the steps. But a closed loop of eight runs
    a pair at its capacity, prompts queueing behind each other's prefills, and each prompt's
    prefill overhead fitted on that TTFT over-predicted TTFT at the open-loop rates a deployment
    is sized for by 23-51% (the planner validation at f4e9d5c); the open-loop point, at a rate
    the closed loop showed the pair can carry, sets it instead.

    `speculation_only`: the deployment speculates, and the profile was calibrated on a plain one
    before; only the speculative steps' overheads and each prompt's cost in a prefill with the
    draft are fitted (`calibrate_speculation.calibrated_speculation`). `colocated_only`: the
    deployment is colocated and plain, and the profile was calibrated on a disaggregated one
    before; the colocated worker's own steps are fitted (`calibrate_colocated.calibrated_colocated`)."""
    from pdserve.loadgen.bench import run_bench

    if num_requests < 2:
        raise ValueError(f"calibrating needs at least 2 requests per point, got {num_requests}")
    if concurrency < 0 or concurrency == 1:
        raise ValueError(f"concurrency must be 0 (unloaded only) or at least 2, got {concurrency}")
    if not 0 <= open_fraction < 1:
        raise ValueError(f"open_fraction must be in [0, 1) (of the closed loop's throughput), got {open_fraction}")
    if speculation_only and not shape.speculate:
        raise ValueError("speculation_only calibrates a speculating deployment (--speculation)")
    if colocated_only and (not shape.is_colocated or shape.speculate):
        raise ValueError("colocated_only calibrates a plain colocated deployment (--prefill-workers 0, "
                         "without --speculation)")
    unloaded_config = dataclasses.replace(config, rates=(math.inf,), num_requests=num_requests, max_concurrency=1,
                                          duration_s=None, search=None)
    one_at_a_time = run_bench(unloaded_config, progress=progress)
    records = one_at_a_time.runs[0].records
    _check_measured(records, "unloaded")
    _check_speculation(records, shape.speculate)
    alpha = None
    if shape.speculate:  # the deployment's own α: the profile's was measured on its own prompts
        alpha = acceptance(records, profile.speculation.num_speculative_tokens)
    loaded, inputs, opened, open_inputs, open_rate = None, None, None, None, 0.0
    if concurrency:
        loaded_config = dataclasses.replace(unloaded_config, max_concurrency=concurrency,
                                            num_requests=loaded_requests or 4 * concurrency)
        busy = run_bench(loaded_config, progress=progress).runs[0].records
        _check_measured(busy, f"loaded ({concurrency} in flight)")
        loaded, inputs = Point.of(busy), sent_inputs(loaded_config, busy)
        measured = throughput(busy)
        if open_fraction and math.isfinite(measured):
            open_rate = open_fraction * measured
            open_config = dataclasses.replace(loaded_config, rates=(open_rate,), max_concurrency=None)
            arrived = run_bench(open_config, progress=progress).runs[0].records
            _check_measured(arrived, f"open-loop ({open_rate:.2f} requests/s)")
            opened, open_inputs = Point.of(arrived), sent_inputs(open_config, arrived)
    if colocated_only:
        from pdserve.loadgen.calibrate_colocated import calibrated_colocated

        return calibrated_colocated(profile, shape, Point.of(records), unloaded_config, loaded, inputs, concurrency,
                                    opened, open_inputs, open_rate)
    if speculation_only:
        from pdserve.loadgen.calibrate_speculation import calibrated_speculation

        return calibrated_speculation(profile, shape, Point.of(records), unloaded_config, loaded, inputs, alpha,
                                      concurrency, opened, open_inputs, open_rate)
    return calibrated(profile, shape, Point.of(records), unloaded_config, loaded, inputs, alpha, concurrency,
                      opened, open_inputs, open_rate)


def throughput(records: list[RequestRecord]) -> float:
    """Requests finished per second over a run, from the first sent to the last ended."""
    start, end = min(r.sent_s for r in records), max(r.end_s for r in records)
    return len(records) / (end - start) if end > start else math.inf


def _decode_step_tokens(records: list[RequestRecord]) -> list[float]:
    """The tokens each whole decode step streamed a request: its deltas but the first (the
    prefill's token) and the last (a step cut short by max_tokens). A delta whose server counted
    the engine steps it carries (`GenerateResponse.num_steps`) counts as that many steps of its
    mean: a decode worker merges the steps queued for a stream that fell behind its engine (as
    beside the test cluster's tiny model, whose steps outrun the serving loop) and groups them
    under `stream_interval`. Taken as one step each, such deltas read the test cluster's
    self-drafting pair that accepts everything at 5.18 tokens a step against its 4, and would read
    a plain deployment whose streams merge (1.4-1.7 tokens a message beside a fast engine:
    BENCHMARKS.md, Streaming cost per token) as a speculating one. Where some requests streamed
    more than one token a step, only those count, from their first such step: a disaggregated
    decode worker with a draft starts on the target's K/V and decodes plainly until the draft's
    land (`KVTargetReady`). On the test cluster's tiny model, whose steps (0.1-0.6 ms) are far
    shorter than that wait (2.7-8 ms in a scratch timing: the prefill worker's draft pass and the
    messages' hops between three processes on two cores), those plain steps made a
    self-drafting pair that accepts everything read 1.06 tokens a step, and a short request
    could end before its draft's K/V landed. A first such delta that merged several steps may
    hold the last plain ones beside the first speculative (six tokens over three steps read as
    two a step): it is left out where later deltas follow. In a loaded CI run such deltas read
    that pair at 3.79 tokens a step against its 4."""
    deltas = [list(zip(r.delta_tokens, r.delta_steps or [0] * len(r.delta_tokens)))[1:-1] for r in records if r.is_ok]
    firsts = [next((i for i, (n, s) in enumerate(d) if n > max(s, 1)), None) for d in deltas]
    if all(first is None for first in firsts):
        return [n for d in deltas for n in _per_step(d)]
    out = []
    for d, first in zip(deltas, firsts):
        if first is None:
            continue
        if d[first][1] > 1 and first + 1 < len(d):
            first += 1  # merged steps where the plain ones may meet the first speculative: their mean is neither
        out += _per_step(d[first:])
    return out


def _per_step(deltas: list[tuple[int, int]]) -> list[float]:
    """Each delta's tokens as `steps` steps of their mean (one step where not counted: 0)."""
    return [n / s if s > 0 else n for n, s in deltas for _ in range(max(s, 1))]


def _check_speculation(records: list[RequestRecord], speculate: bool) -> None:
    """Refuse a deployment calibrated as what it is not: a plain decode step streams one token
    a sequence, a speculative one its accepted drafts too. Calibrated as plain, `pdserve serve`'s
    default pair (adaptive speculation) measured 0.86 ms a token unloaded, cheaper than the plain
    steps the simulator made of the engine's profile (1.04 ms), so the step overhead came out 0
    without a word, and the loaded point's overheads fitted a mix of both modes."""
    steps = _decode_step_tokens(records)
    if not steps:
        return
    per_step = sum(steps) / len(steps)
    if not speculate and per_step > SPECULATING_TOKENS_PER_STEP:
        raise ValueError(f"calibration: the deployment speculates (its decode steps streamed {per_step:.2f} tokens "
                         "each): calibrate it with --speculation and a profile with speculation costs, with its "
                         "decode workers at a fixed depth (--no-spec-adaptive; engine spec_adaptive: false), or "
                         "deploy it with --no-speculation")
    if speculate and per_step <= SPECULATING_TOKENS_PER_STEP:
        raise ValueError(f"calibration: --speculation, but the deployment's decode steps streamed {per_step:.2f} "
                         "tokens each: it does not speculate (or its adaptive depth chose plain decoding, or "
                         "every request ended before its draft's K/V landed: give them longer outputs)")


def _check_measured(records: list[RequestRecord], what: str) -> None:
    failed = [r for r in records if not r.is_ok]
    if failed:
        raise ValueError(f"calibration: {len(failed)} of {len(records)} {what} requests failed (the first: "
                         f"{failed[0].status} {failed[0].error}): the deployment must serve them all")

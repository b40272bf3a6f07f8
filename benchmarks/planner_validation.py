"""The planner's simulator against the real system: predicted vs measured latencies and goodput
for a few configurations of the demo pair on this machine.

    python benchmarks/planner_validation.py [--quick] [--profile FILE] [--repeats 3]

1. Profile: `pdserve profile` on the demo pair pinned to core 0 with one torch thread (or a
   given --profile), as the workers below run.
2. Three systems at once, workers single-threaded and pinned one per core: 1P:1D, 1P:1D with
   speculation (k = 4, fixed depth), and 2 colocated decode workers. Beside a disaggregated pair
   the router and the load generator (this process) run on the prefill worker's core, so the
   decode worker's core is its own (`harness_cpus`).
3. The router's own overhead (arrival to the workers starting) and the serving loop's per step
   and per sequence of a step (streaming each step's tokens through the router) are not in the
   profile, which times the engine alone: they are calibrated once on 1P:1D as `pdserve
   calibrate` does (`loadgen/calibrate.py`: requests one at a time, then 40 with eight in flight
   replayed at the times they were sent, then 40 arriving open loop at 0.75 of the throughput
   those eight measured; their TTFT, the gap from the first token to the second and the time per
   token after it; --no-calibrate to leave the profile as measured), and the speculative steps'
   own overheads, each prompt's cost in a prefill with the draft and the acceptance rate on
   1P:1D +spec as `pdserve calibrate --speculation-only` does (the same three points; the
   profile's α is measured on its own prompts, and a speculative step streams 2-3 tokens a
   sequence, which the plain pair's overheads a step do not pay), and the colocated workers' own
   steps on 2 colocated as `pdserve calibrate --colocated-only` does (the same three points:
   priced with the 1P:1D pair's overheads, their TTFT came out 29-33% over the measured;
   --no-colocated-calibration to keep that). The rates validated are predicted, not calibrated.
4. For each configuration: SLOs at 3x its measured unloaded TTFT and 2x its TPOT (p90s); the
   simulator's goodput on the exact traffic bench sends (same arrival times and lengths), which
   picks the rates below and brackets the measured goodput's bisection; measured latencies at
   fractions of that rate and measured goodput, each repeat on its own traffic (seed), beside the
   simulator's for that same traffic: the same rate's requests differ more from seed to seed
   than the simulator from the system (goodput 14.6 against 9.5 predicted for two colocated
   workers' seeds 0 and 1; a seed-0 prediction against the median over seeds read +21% where the
   repeats were -9% and +17%). Errors are per repeat, min / median / max. Goal: medians and
   goodput within 15% in every repeat.

Writes benchmarks/results/planner_validation.json and .png and prints Markdown tables.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # launcher.py, beside this script

from launcher import Launcher  # noqa: E402

from pdserve.cluster.local import PDSERVE  # noqa: E402

from pdserve.loadgen.bench import BenchConfig, RateSearch, run_bench  # noqa: E402
from pdserve.loadgen.calibrate import OPEN_FRACTION, Calibration, calibrate as calibrate_profile, predict  # noqa: E402
from pdserve.loadgen.costs import CostProfile  # noqa: E402
from pdserve.loadgen.goodput import Bisection  # noqa: E402
from pdserve.loadgen.lengths import LengthDistribution  # noqa: E402
from pdserve.loadgen.simulator import Shape  # noqa: E402
from pdserve.loadgen.stats import SLO  # noqa: E402
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL, DRAFT = str(REPO / "models" / "demo"), str(REPO / "models" / "demo-draft")
NUM_KV_BLOCKS, MAX_NUM_SEQS = 1024, 32
WORKER = ["--model", MODEL, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS)]
SPEC = ["--draft-model", DRAFT, "--num-speculative-tokens", "4", "--no-spec-adaptive"]
CONFIGS = {"1P:1D": Shape(1, 1), "1P:1D +spec": Shape(1, 1, True), "2 colocated": Shape(0, 2)}
GOAL = 0.15  # medians and goodput within this of the measured, in every repeat


def harness_cpus(shape: Shape) -> list[int] | None:
    """Where the router and this process (the load generator) run beside a configuration's
    workers: disaggregated, on the prefill worker's core; colocated, on both (each has a decode
    worker). Left to float over both cores beside a 1P:1D pair, they took the decode worker's
    core often enough to set the pair's goodput: its engine thread was off the core for 28% of
    its steps' time, and at 16-20 requests/s 5-17% of requests missed the TPOT SLO (p90 3.0-4.2
    ms, against 2.1-2.3 ms and 0-1% with them on core 0; scratch probe, the same rates and seeds).
    In a deployment the router runs on other cores than the workers', and the simulator models
    none of it."""
    return None if shape.is_colocated else [0]


@contextlib.contextmanager
def pinned(shape: Shape):
    """This process on `harness_cpus(shape)` while it drives that configuration."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, harness_cpus(shape) or before)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def workload() -> WorkloadConfig:
    return WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse("lognormal:256,0.6,1024"),
                          LengthDistribution.parse("uniform:16,64"), tokenizer=MODEL)


def start(run: Launcher, name: str, shape: Shape):
    tag = name.replace(" ", "_").replace(":", "").replace("+", "")
    spec = SPEC if shape.speculate else []
    if shape.is_colocated:
        decode, prefill = [run.worker("decode-worker", f"{tag}-D{c}", WORKER + spec, [c]) for c in (0, 1)], []
    else:
        prefill = [run.worker("prefill-worker", f"{tag}-P", WORKER + (["--draft-model", DRAFT] if shape.speculate
                                                                       else []), [0])]
        decode = [run.worker("decode-worker", f"{tag}-D", WORKER + spec, [1])]
    return run.router(f"{tag}-R", MODEL, prefill, decode, extra=["--queue-timeout", "120"],
                      cpus=harness_cpus(shape))


def get_profile(args) -> CostProfile:
    path = Path(args.profile) if args.profile else Path(args.out + "_profile.json")  # a smoke run's beside its files
    if not args.profile:
        cmd = [PDSERVE, "profile", "--model", MODEL, "--draft-model", DRAFT, "--num-speculative-tokens", "4",
               "--cpus", "0", "--num-threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS), "--output", str(path)]
        subprocess.run(cmd + (["--quick"] if args.quick else []), check=True, stdout=subprocess.DEVNULL)
    profile = CostProfile.load(path)
    limits = dataclasses.replace(profile.limits, kv_capacity_tokens=NUM_KV_BLOCKS * 16, max_num_seqs=MAX_NUM_SEQS)
    return dataclasses.replace(profile, limits=limits)


def bench(address: str, rates=(), **kw) -> list:
    cfg = BenchConfig(target=address, workload=workload(), rates=tuple(rates), **kw)
    return run_bench(cfg, progress=False)


def predicted_goodput(profile, shape, cfg: BenchConfig, low: float, high: float, steps: int):
    search = Bisection(low, high, steps)
    while (rate := search.next_rate()) is not None:
        search.record(rate, predict(profile, shape, cfg, rate).slo_attainment)
    return search.result()


def calibrate(profile: CostProfile, addresses: dict, num: int, open_fraction: float = OPEN_FRACTION,
              colocated: bool = True) -> tuple[CostProfile, dict, dict, dict | None]:
    """`pdserve calibrate`'s calibration on 1P:1D (unloaded; 40 requests, eight in flight; 40
    more open loop at `open_fraction` of the throughput those eight measured), then `pdserve
    calibrate --speculation-only`'s on 1P:1D +spec the same way (unloaded, which also gives
    speculation's acceptance rate): the speculative steps' own overheads, and each prompt's cost
    in a prefill with the draft; then, with `colocated`, `pdserve calibrate --colocated-only`'s on
    the 2 colocated workers the same way: their own decode steps, prompts and request overhead."""
    cfg = BenchConfig(target=addresses["1P:1D"], workload=workload(), num_warmup=2, seed=100)
    with pinned(CONFIGS["1P:1D"]):
        profile, cal = calibrate_profile(profile, CONFIGS["1P:1D"], cfg, num, concurrency=8, loaded_requests=40,
                                         open_fraction=open_fraction)
    spec = dataclasses.replace(cfg, target=addresses["1P:1D +spec"])
    with pinned(CONFIGS["1P:1D +spec"]):
        profile, spec_cal = calibrate_profile(profile, CONFIGS["1P:1D +spec"], spec, num, concurrency=8,
                                              loaded_requests=40, open_fraction=open_fraction,
                                              speculation_only=True)
    colocated_cal = None
    if colocated:
        name = "2 colocated"
        with pinned(CONFIGS[name]):
            profile, colocated_cal = calibrate_profile(profile, CONFIGS[name], dataclasses.replace(
                cfg, target=addresses[name]), num, concurrency=8, loaded_requests=40, open_fraction=open_fraction,
                colocated_only=True)
        colocated_cal = colocated_cal.to_json()
    return profile, cal.to_json(), spec_cal.to_json(), colocated_cal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="quick profile, one repeat, few requests")
    p.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--load-fractions", default="0.5,0.8", help="of the predicted goodput, for the latency rows")
    p.add_argument("--search-steps", type=int, default=5, help="bisection steps of each measured goodput, "
                   "after the bracket's ends (3 left a grid of 15%% steps, the goal's size: the goodput "
                   "found, the highest passing rate, read up to 15%% low)")
    p.add_argument("--no-calibrate", action="store_true")
    p.add_argument("--no-colocated-calibration", action="store_true", help="price the colocated workers with the "
                   "1P:1D pair's overheads, as before `pdserve calibrate --colocated-only`")
    p.add_argument("--open-fraction", type=float, default=OPEN_FRACTION, help="the calibration's open-loop "
                   "point, as a fraction of the request throughput its closed loop measured (0: none)")
    p.add_argument("--out", default=None, help="path stem of the JSON and PNG (default: "
                   "benchmarks/results/planner_validation, with _quick after it for --quick)")
    args = p.parse_args()
    if args.out is None:  # a smoke run leaves the measured files alone
        args.out = str(RESULTS / ("planner_validation_quick" if args.quick else "planner_validation"))
    if args.quick:
        args.repeats, args.num_requests, args.load_fractions, args.search_steps = 1, 12, "0.6", 1
    profile = get_profile(args)
    with tempfile.TemporaryDirectory() as logs, Launcher(Path(logs)) as run:
        routers = {name: start(run, name, shape) for name, shape in CONFIGS.items()}
        run.wait_ready()
        addresses = {name: r.address for name, r in routers.items()}
        calibration = spec_calibration = colocated_calibration = None
        if not args.no_calibrate:
            profile, calibration, spec_calibration, colocated_calibration = calibrate(
                profile, addresses, 4 if args.quick else 10, args.open_fraction, not args.no_colocated_calibration)
        result = validate(profile, addresses, args)
    result.update(calibration=calibration, speculation_calibration=spec_calibration,
                  colocated_calibration=colocated_calibration, profile=profile.to_json(), config=vars(args))
    report(result, args)


def validate(profile: CostProfile, addresses: dict, args) -> dict:
    fractions = [float(x) for x in args.load_fractions.split(",")]
    plans = {}
    for name, shape in CONFIGS.items():  # SLOs, predicted goodput and the rates to measure at
        with pinned(shape):
            plans[name] = plan_config(profile, shape, addresses[name], fractions, args)
    rows, goodputs, searches = {n: [] for n in CONFIGS}, {n: [] for n in CONFIGS}, {n: [] for n in CONFIGS}
    for r in range(args.repeats):
        for name in list(CONFIGS)[r % 3:] + list(CONFIGS)[:r % 3]:
            plan, cfg = plans[name], plans[name]["cfg"]
            with pinned(CONFIGS[name]):
                measured = run_bench(dataclasses.replace(cfg, rates=tuple(plan["rates"]), seed=r), progress=False)
                search = run_bench(dataclasses.replace(cfg, rates=(), search=RateSearch(*plan["search"],
                                                                                        args.search_steps), seed=r),
                                   progress=False)
            rows[name].append([s.to_json() for s in measured.summaries()])
            goodputs[name].append(search.goodput["bisection"].rate or 0.0)
            searches[name].append([(s.rate, s.slo_attainment) for s in search.summaries()])
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    out = {"configs": {}}
    for name, shape in CONFIGS.items():
        plan = plans[name]
        # each repeat's traffic (seed r) predicted on its own: the same rate's requests differ more
        # from seed to seed (the prompt lengths' long tail) than the simulator from the system
        predicted = [[predict(profile, shape, dataclasses.replace(plan["cfg"], seed=r), rate).to_json()
                      for rate in plan["rates"]] for r in range(args.repeats)]
        low, high = plan["search_predicted"]
        predicted_goodputs = [predicted_goodput(profile, shape, dataclasses.replace(plan["cfg"], seed=r), low, high,
                                                8).rate or 0.0 for r in range(args.repeats)]
        out["configs"][name] = {"slo": dataclasses.asdict(plan["slo"]), "rates": plan["rates"],
                                "predicted": predicted, "measured": rows[name],
                                "predicted_goodput": predicted_goodputs, "measured_goodput": goodputs[name],
                                "measured_search": searches[name]}
        if shape.is_colocated and profile.colocated is not None:  # the same run, priced as the pair's
            as_pair = dataclasses.replace(profile, colocated=None)
            out["configs"][f"{name}, priced as 1P:1D"] = {
                **out["configs"][name],
                "predicted": [[predict(as_pair, shape, dataclasses.replace(plan["cfg"], seed=r), rate).to_json()
                               for rate in plan["rates"]] for r in range(args.repeats)],
                "predicted_goodput": [predicted_goodput(as_pair, shape, dataclasses.replace(plan["cfg"], seed=r), low,
                                                        high, 8).rate or 0.0 for r in range(args.repeats)]}
    return out


def plan_config(profile: CostProfile, shape: Shape, address: str, fractions: list[float], args) -> dict:
    """SLOs from this configuration's unloaded p90s (the prompt lengths have a long tail), the
    simulator's goodput for them, and the rates at which to compare latencies."""
    unloaded = bench(address, (float("inf"),), num_requests=6 if args.quick else 16, max_concurrency=1,
                     num_warmup=1, seed=100).summaries()[0]
    slo = SLO(3 * unloaded.ttft.p90, 2 * unloaded.tpot.p90)
    cfg = BenchConfig(target=address, workload=workload(), rates=(1.0,), num_requests=args.num_requests,
                      slo=slo, num_warmup=1)
    base = 1 / unloaded.e2e.p50  # about one request in flight
    g = predicted_goodput(profile, shape, cfg, 0.1 * base, 20 * base, 8).rate
    search = (0.5 * g, 1.5 * g) if g else (0.25 * base, 12 * base)
    return {"slo": slo, "cfg": cfg, "rates": [f * (g or base) for f in fractions], "search": search,
            "search_predicted": (0.1 * base, 20 * base), "unloaded": unloaded.to_json()}


def _spread(xs: list[float]) -> tuple[float, float, float]:
    return min(xs), statistics.median(xs), max(xs)


def _error(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else math.nan


def _errors(errs: list[float]) -> str:
    """Per-repeat errors as median (min to max), and whether the worst is within the goal. A
    repeat without an error (nan: its measured goodput lay under the search's bracket, so no
    ratio) is not met, and said so."""
    finite = [e for e in errs if not math.isnan(e)]
    missing = len(errs) - len(finite)
    if not finite:
        return "no repeat measured one, **not met**"
    lo, med, hi = _spread(finite)
    met = "met" if not missing and max(abs(lo), abs(hi)) <= GOAL else "**not met**"
    note = f"; {missing} repeat{'s' if missing > 1 else ''} under the bracket" if missing else ""
    return f"{100 * med:+.0f}% ({100 * lo:+.0f} to {100 * hi:+.0f}%{note}), {met}"


def _goodputs(c: dict) -> str:
    """Each repeat's measured goodput; one under its search's bracket (every rate searched missed
    the SLOs) as "< the bracket's low end", not as 0."""
    return ", ".join(f"{g:.1f}" if g else f"< {min(rate for rate, _ in search):.1f}"
                     for g, search in zip(c["measured_goodput"], c["measured_search"]))


def report(result: dict, args) -> None:
    cmd = " ".join(["python", "benchmarks/planner_validation.py", *sys.argv[1:]])  # exactly as run
    print(f"\n`{cmd}`: predicted by the simulator from the profile for each repeat's requests / measured "
          "with pdserve bench; medians over repeats; error = (predicted - measured) / measured per repeat, "
          f"median (min to max); goal: every repeat within {100 * GOAL:.0f}%\n")
    print("| config | rate (req/s) | TTFT p50 (ms) pred / meas | err | TPOT p50 (ms) pred / meas | err | "
          "TTFT p99 pred / meas | TPOT p99 pred / meas |")
    print("|---|---|---|---|---|---|---|---|")
    for name, c in result["configs"].items():
        for i, rate in enumerate(c["rates"]):
            pred = lambda k, q: statistics.median(rep[i][k][q] for rep in c["predicted"])  # noqa: E731
            meas = lambda k, q: statistics.median(rep[i][k][q] for rep in c["measured"])  # noqa: E731
            errs = {k: [_error(p[i][k]["p50"], m[i][k]["p50"]) for p, m in zip(c["predicted"], c["measured"])]
                    for k in ("ttft", "tpot")}
            print(f"| {name} | {rate:.2f} | {pred('ttft', 'p50') * 1e3:.1f} / {meas('ttft', 'p50') * 1e3:.1f} | "
                  f"{_errors(errs['ttft'])} | {pred('tpot', 'p50') * 1e3:.2f} / {meas('tpot', 'p50') * 1e3:.2f} | "
                  f"{_errors(errs['tpot'])} | {pred('ttft', 'p99') * 1e3:.0f} / {meas('ttft', 'p99') * 1e3:.0f} | "
                  f"{pred('tpot', 'p99') * 1e3:.1f} / {meas('tpot', 'p99') * 1e3:.1f} |")
    print("\n| config | SLO TTFT / TPOT (ms) | goodput predicted, per repeat | measured, per repeat | err |")
    print("|---|---|---|---|---|")
    for name, c in result["configs"].items():
        pred, meas = c["predicted_goodput"], c["measured_goodput"]
        print(f"| {name} | {c['slo']['ttft_s'] * 1e3:.0f} / {c['slo']['tpot_s'] * 1e3:.1f} | "
              f"{', '.join(f'{g:.1f}' for g in pred)} | {_goodputs(c)} | "
              f"{_errors([_error(p, m) for p, m in zip(pred, meas)])} |")
    if result.get("calibration"):
        print(f"\ncalibrated on 1P:1D (loadgen/calibrate.py):\n{Calibration.from_json(result['calibration']).describe()}")
    if result.get("speculation_calibration"):
        print("\nspeculation calibrated on 1P:1D +spec (--speculation-only):\n"
              f"{Calibration.from_json(result['speculation_calibration']).describe()}")
    if result.get("colocated_calibration"):
        print("\ncolocated workers calibrated on 2 colocated (--colocated-only):\n"
              f"{Calibration.from_json(result['colocated_calibration']).describe()}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (name, c) in enumerate(result["configs"].items()):
        for ax, key in zip(axes[:2], ("ttft", "tpot")):
            for j, rate in enumerate(c["rates"]):  # one point per repeat: its traffic predicted and measured
                ax.scatter([rep[j][key]["p50"] * 1e3 for rep in c["predicted"]],
                           [rep[j][key]["p50"] * 1e3 for rep in c["measured"]], color=f"C{i}",
                           label=name if j == 0 else None)
        axes[2].scatter(c["predicted_goodput"], c["measured_goodput"], color=f"C{i}", label=name)
    for ax, what in zip(axes, ("median TTFT (ms)", "median TPOT (ms)", "goodput (req/s)")):
        lo, hi = ax.get_xlim()
        top = max(hi, ax.get_ylim()[1])
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="grey", alpha=0.1)
        ax.set_xlabel(f"predicted {what}")
        ax.set_ylabel(f"measured {what}")
        ax.legend(fontsize=8)
    fig.suptitle("planner validation: simulator vs pdserve bench (band: ±15%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

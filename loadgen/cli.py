"""Arguments of `pdserve bench` and `pdserve plan`, and what running them means. `cluster/cli.py`
registers the subcommands; this module imports only argparse until a command runs.

Bad input (an unknown distribution, a negative rate, an unreachable target) raises ValueError
with one line that names the flag; the `pdserve` entry point prints it and exits 2.
"""
from __future__ import annotations

import argparse
import math
import sys


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="drive load against a running system; latency, throughput, goodput",
                       description="Open-loop load against a running pdserve router (gRPC or OpenAI HTTP).")
    _add_target_and_workload_args(p)
    load = p.add_argument_group("load")
    rate = load.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", default=None, help="requests per second (or inf: all at once)")
    rate.add_argument("--request-rates", default=None, help="a sweep: 1,2,4 or START:STOP:STEP or START:STOP:xFACTOR")
    load.add_argument("--goodput-search", default=None, metavar="LOW:HIGH",
                      help="bisect the rate between LOW and HIGH for the goodput (needs an SLO)")
    load.add_argument("--search-steps", type=int, default=4, help="bisection steps after both ends")
    load.add_argument("--arrival", default="poisson", help="poisson | gamma")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson-like, < 1 burstier")
    load.add_argument("--num-requests", type=int, default=None, help="per rate (default 100 without --duration)")
    load.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=1, help="requests sent one at a time first, not measured")
    load.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    load.add_argument("--connections", type=int, default=1, help="gRPC connections the requests take in turn "
                      "(router processes sharing a port get connections, not requests; HTTP opens what it needs)")
    out = p.add_argument_group("objectives and output")
    out.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    out.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    out.add_argument("--output", default=None, help="FILE.json (a PNG is written beside it)")
    out.add_argument("--no-plot", action="store_true")
    out.add_argument("--label", default="", help="this configuration's name in plots")
    out.add_argument("--compare", nargs="*", default=[], help="earlier --output files to plot beside this run")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=bench_main)
    return p


def _add_target_and_workload_args(p: argparse.ArgumentParser) -> None:
    """The router to drive and the requests to send: `pdserve bench`'s and `pdserve calibrate`'s."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="the router's gRPC address, HOST:PORT")
    where.add_argument("--http", help="the router's OpenAI-compatible base URL, http://HOST:PORT")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer <key>'")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="code", help="random | code (stdlib source cuts) | jsonl (--dataset)")
    w.add_argument("--dataset", default=None, help="JSONL file: {\"prompt\": str | [ids], \"max_tokens\": n} per line")
    w.add_argument("--tokenizer", default=None, help="tokenizer.json or model dir: exact token lengths for 'code'")
    w.add_argument("--prompt-len", default="uniform:32,256", help="fixed:N | uniform:LO,HI | lognormal:MEAN,SIGMA[,MAX]")
    w.add_argument("--output-len", default="uniform:16,128", help="same forms as --prompt-len")
    w.add_argument("--vocab-size", type=int, default=256, help="random prompts draw token ids below this")
    w.add_argument("--chars-per-token", type=float, default=4.0, help="'code' without --tokenizer")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--top-p", type=float, default=None)
    w.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: exact lengths)")


def parse_rate(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a number") from None
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{flag}: a request rate must be > 0 (or inf), got {text}")
    return value


def parse_rates(text: str, flag: str = "--request-rates") -> tuple[float, ...]:
    """'1,2,4', 'START:STOP:STEP' (inclusive) or 'START:STOP:xFACTOR'."""
    if ":" not in text:
        return tuple(parse_rate(t, flag) for t in text.split(",") if t.strip())
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"{flag}: a range is START:STOP:STEP, got {text!r}")
    start, stop = parse_rate(parts[0], flag), parse_rate(parts[1], flag)
    is_geometric = parts[2].startswith("x")
    step = parse_rate(parts[2].removeprefix("x"), flag)
    if stop < start or (is_geometric and step <= 1) or math.isinf(stop):
        raise ValueError(f"{flag}: {text!r} needs START <= STOP (finite) and a step > 0 (a factor > 1)")
    rates, r = [], start
    while r <= stop * (1 + 1e-9) and len(rates) < 1000:
        rates.append(round(r, 9))
        r = r * step if is_geometric else r + step
    return tuple(rates)


def config_from_args(args: argparse.Namespace):
    from pdserve.loadgen.arrivals import ArrivalKind
    from pdserve.loadgen.backends import BenchSampling
    from pdserve.loadgen.bench import BenchConfig, RateSearch
    from pdserve.loadgen.lengths import LengthDistribution
    from pdserve.loadgen.stats import SLO
    from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind

    kind = _enum(WorkloadKind, args.workload, "--workload")
    arrival = _enum(ArrivalKind, args.arrival, "--arrival")
    workload = WorkloadConfig(kind, _length(LengthDistribution, args.prompt_len, "--prompt-len"),
                              _length(LengthDistribution, args.output_len, "--output-len"), args.vocab_size,
                              args.dataset, args.tokenizer, args.chars_per_token)
    rates = parse_rates(args.request_rates) if args.request_rates else ()
    if args.request_rate is not None:
        rates = (parse_rate(args.request_rate, "--request-rate"),)
    search = None
    if args.goodput_search:
        low, _, high = args.goodput_search.partition(":")
        if not high:
            raise ValueError(f"--goodput-search: use LOW:HIGH, got {args.goodput_search!r}")
        search = RateSearch(parse_rate(low, "--goodput-search"), parse_rate(high, "--goodput-search"),
                            args.search_steps)
    elif not rates:
        rates = (math.inf,)
    num = args.num_requests if args.num_requests is not None or args.duration is not None else 100
    sampling = BenchSampling(args.temperature, args.top_p, not args.no_ignore_eos)
    return BenchConfig(args.target, args.http, workload, rates, arrival, args.burstiness, num, args.duration,
                       args.max_concurrency, args.seed, SLO(args.slo_ttft, args.slo_tpot), sampling,
                       args.request_timeout, search, args.label, args.api_key, args.warmup, args.connections)


def _enum(cls, value: str, flag: str):
    try:
        return cls(value.lower())
    except ValueError:
        raise ValueError(f"{flag}: unknown value {value!r}; use one of {', '.join(k.value for k in cls)}") from None


def _length(cls, spec: str, flag: str):
    try:
        return cls.parse(spec)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def bench_main(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pdserve.loadgen.bench import format_table, run_bench
    from pdserve.loadgen.stats import RunSummary

    config = config_from_args(args)
    compare = {}
    for path in args.compare:
        try:
            obj = json.loads(Path(path).read_text())
            compare[obj["config"].get("label") or path] = [RunSummary.from_json(r["summary"]) for r in obj["runs"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--compare: cannot read {path}: {e}") from None
    result = run_bench(config, progress=not args.quiet)
    print(format_table(result.summaries()))
    for goodput in result.goodput.values():
        print(goodput.describe())
    if args.output:
        written = result.write(args.output, plot=False)
        if not args.no_plot:
            from pdserve.loadgen.plot import plot_sweeps

            label = config.label or "this run"
            written.append(plot_sweeps({label: result.summaries(), **compare},
                                       Path(args.output).with_suffix(".png"), config.slo))
        print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    return 0


def add_plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="size the prefill and decode pools from a cost profile, by simulation",
                       description="For a cost profile (pdserve profile, or assumed figures), traffic and SLOs: "
                                   "goodput of every P:D shape (and colocated) up to --max-workers.")
    p.add_argument("--profile", required=True, help="cost profile JSON")
    p.add_argument("--prompt-len", default="uniform:32,256", help="fixed:N | uniform:LO,HI | lognormal:MEAN,SIGMA[,MAX]")
    p.add_argument("--output-len", default="uniform:16,128")
    p.add_argument("--arrival", default="poisson", help="poisson | gamma")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    p.add_argument("--request-rate", type=float, default=None, help="target rate: the smallest shape reaching it")
    p.add_argument("--max-workers", type=int, default=6)
    p.add_argument("--speculation", default="auto", help="off | on | both | auto (both if the profile has it)")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated shapes")
    p.add_argument("--num-requests", type=int, default=400, help="simulated requests per rate")
    p.add_argument("--search-steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="FILE.json")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=plan_main)
    return p


def plan_main(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pdserve.loadgen.arrivals import ArrivalKind, ArrivalProcess
    from pdserve.loadgen.costs import CostProfile
    from pdserve.loadgen.lengths import LengthDistribution
    from pdserve.loadgen.planner import PlanConfig, plan
    from pdserve.loadgen.simulator import Traffic
    from pdserve.loadgen.stats import SLO

    profile = CostProfile.load(args.profile)
    arrival = _enum(ArrivalKind, args.arrival, "--arrival")
    ArrivalProcess(1.0, arrival, args.burstiness)
    traffic = Traffic(_length(LengthDistribution, args.prompt_len, "--prompt-len"),
                      _length(LengthDistribution, args.output_len, "--output-len"), arrival, args.burstiness)
    modes = {"off": (False,), "on": (True,), "both": (False, True),
             "auto": (False, True) if profile.speculation else (False,)}
    if args.speculation not in modes:
        raise ValueError(f"--speculation: use one of {', '.join(modes)}, got {args.speculation!r}")
    config = PlanConfig(SLO(args.slo_ttft, args.slo_tpot), args.max_workers, args.num_requests, args.seed,
                        args.search_steps, modes[args.speculation], not args.no_colocated)
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(config.shapes()), desc="shapes", leave=False)
    try:
        result = plan(profile, traffic, config, args.request_rate, bar)
    finally:
        if bar is not None:
            bar.close()
    print(f"{profile.model} on {profile.hardware}; prompts {traffic.prompt_len.spec}, outputs "
          f"{traffic.output_len.spec}, {arrival.value} arrivals; SLO TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s")
    if config.include_colocated:
        print("colocated shapes: " + ("their own steps (pdserve calibrate --colocated-only)" if profile.colocated else
                                      "priced with the profile's disaggregated steps (pdserve calibrate "
                                      "--colocated-only on a colocated deployment gives them their own)"))
    print(result.format_markdown())
    print("\n".join(result.answer()))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result.to_json(), indent=1))
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def add_calibrate_parser(sub) -> argparse.ArgumentParser:
    from pdserve.loadgen.calibrate import OPEN_FRACTION

    p = sub.add_parser("calibrate", help="add a running deployment's serving overheads to a cost profile",
                       description="Measure a running deployment unloaded and under load, beside the simulator's "
                                   "prediction for the same requests, and write the profile with the router's and the "
                                   "serving loop's overheads added (per request, per decode step, per sequence of a "
                                   "step, per prompt prefilled, per prompt's K/V handed over), which `pdserve profile` "
                                   "cannot time: then `pdserve plan` on it. Outputs need 3 tokens or more.")
    p.add_argument("--profile", required=True, help="cost profile JSON (pdserve profile) of the deployment's model")
    p.add_argument("--output", required=True, help="the calibrated profile JSON to write")
    p.add_argument("--prefill-workers", type=int, default=1, help="of the running deployment (0: colocated)")
    p.add_argument("--decode-workers", type=int, default=1, help="of the running deployment")
    p.add_argument("--speculation", action="store_true", help="the deployment's decode workers speculate, at the "
                   "profile's fixed depth (--no-spec-adaptive): their acceptance rate is measured too")
    p.add_argument("--speculation-only", action="store_true", help="a speculating deployment (implies "
                   "--speculation), and a --profile calibrated on a plain one before: measure only what is "
                   "speculation's own (its steps' overheads beyond the plain ones, each prompt's cost in a prefill "
                   "with the draft, its acceptance rate) and keep the others")
    p.add_argument("--colocated-only", action="store_true", help="a plain colocated deployment (with "
                   "--prefill-workers 0), and a --profile calibrated on a disaggregated one before: fit a colocated "
                   "worker's own steps (its decode steps, each prompt it prefills, a request's overhead), which "
                   "`pdserve plan` then prices colocated shapes with, and keep the others")
    _add_target_and_workload_args(p)
    p.add_argument("--num-requests", type=int, default=16, help="requests measured one at a time")
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests in flight at the loaded point (0: calibrate unloaded only)")
    p.add_argument("--loaded-requests", type=int, default=None, help="requests at the loaded point "
                   "(default: 4 x --concurrency)")
    p.add_argument("--open-fraction", type=float, default=OPEN_FRACTION,
                   help="after the loaded point, as many requests again arrive open loop at this fraction of the "
                   "request throughput it measured; their TTFT sets each prompt's prefill overhead (0: the loaded "
                   "point's TTFT does)")
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--connections", type=int, default=1, help="gRPC connections the requests take in turn (a "
                   "deployment with router.processes above 1: one each at least)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=calibrate_main, request_rate=None, request_rates=None, goodput_search=None, search_steps=4,
                   arrival="poisson", burstiness=1.0, duration=None, max_concurrency=None, warmup=1,
                   request_timeout=300.0, slo_ttft=None, slo_tpot=None, label="")
    return p


def calibrate_main(args: argparse.Namespace) -> int:
    from pdserve.loadgen.calibrate import calibrate
    from pdserve.loadgen.costs import CostProfile
    from pdserve.loadgen.simulator import Shape

    profile = CostProfile.load(args.profile)
    shape = Shape(args.prefill_workers, args.decode_workers, args.speculation or args.speculation_only)
    if shape.speculate and profile.speculation is None:
        raise ValueError(f"--speculation: {args.profile} has no speculation costs (pdserve profile --draft-model)")
    if args.speculation_only and "calibration" not in profile.notes:
        raise ValueError(f"--speculation-only: {args.profile} was not calibrated (pdserve calibrate on a plain "
                         "deployment first; or --speculation to calibrate every overhead on this one)")
    if args.colocated_only:
        if args.speculation_only or args.speculation or args.prefill_workers != 0:
            raise ValueError("--colocated-only: calibrate a plain colocated deployment (--prefill-workers 0, "
                             "without --speculation or --speculation-only)")
        if "calibration" not in profile.notes:
            raise ValueError(f"--colocated-only: {args.profile} was not calibrated (pdserve calibrate on a "
                             "disaggregated deployment first; or without --colocated-only to calibrate every "
                             "overhead on this one)")
    config = config_from_args(args)
    profile, cal = calibrate(profile, shape, config, args.num_requests, args.concurrency, args.loaded_requests,
                             progress=not args.quiet, open_fraction=args.open_fraction,
                             speculation_only=args.speculation_only, colocated_only=args.colocated_only)
    profile.save(args.output)
    print(f"{shape.label}: {cal.describe()}")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0

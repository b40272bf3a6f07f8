"""Streaming cost per token: the CPU each thread of a served pair spends on one generated token.

    python benchmarks/stream_cost.py [--quick] [--repeats 5] [--concurrency 1 8 32] [--stream-interval 4]

Two disaggregated pairs of the demo target over one prefill worker: decode workers that stream
every token (`--stream-interval 1`, the default) and that send a request's tokens once
--stream-interval are new (its first and last at once), each with its router. The prefill worker
and the routers on core 0, the decode workers on core 1 (a worker's engine thread and its serving
loop share that core, as in any one-process worker), single-threaded; the load generator (this
process) on core 0. Only one pair has requests at a time. Per concurrency C, `pdserve bench` keeps C requests of 64-token prompts and
128 greedy tokens in flight (closed loop), and the workers' and router's `/metrics` are scraped
around it: the CPU seconds of each process (`process_cpu_seconds_total`) and of its long-lived
threads (`pdserve:thread_cpu_seconds_total`: the engine thread, the serving loop, grpc.aio's
poller), over the tokens the router sent (`pdserve:generation_tokens_total`). Microseconds per
token, min / median / max over --repeats repeats, the concurrencies and the pairs interleaved (the
order reversed every repeat).

The decode worker's engine thread gets cheaper per token as the batch grows; its serving loop,
which writes every token of every request as a gRPC message of its own, and the router's, which
reads each and writes it on to the client, do not. The last columns are derived, not measured:
the tokens/s at which each loop would take a whole core (10^6 / its µs a token) beside the
engine's (the same for the engine thread): where a loop's is the lower, the loop, not the model,
caps what the process can serve, whatever the accelerator does.

Writes benchmarks/results/stream_cost.json and .png and the "Streaming cost per token" section of
BENCHMARKS.md (not with --quick, --no-markdown or another --out).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from pdserve.loadgen.bench import BenchConfig, run_bench
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from launcher import Launcher, samples  # noqa: E402
from report import Spread, fmt_spread, host, machine, publish  # noqa: E402
RESULTS = REPO / "benchmarks" / "results"
SECTION = "Streaming cost per token (`benchmarks/stream_cost.py`)"
MODEL = str(REPO / "models" / "demo")
PROMPT_LEN, OUTPUT_LEN = "fixed:64", "fixed:128"
# what each column reads: (process, thread role or None for the whole process)
COLUMNS = {"decode engine": ("D", "engine"), "decode loop": ("D", "server"), "decode poller": ("D", "grpc_poller"),
           "decode process": ("D", None), "router loop": ("R", "server"), "router process": ("R", None),
           "prefill process": ("P", None)}


def cpu_seconds(metrics_address: str) -> dict:
    """{role: seconds} of the process's threads, with None for the whole process, and the router's
    generated tokens under "tokens"."""
    out: dict = {}
    for s in samples(metrics_address):
        if s.name == "pdserve:thread_cpu_seconds_total":
            out[s.labels["thread"]] = s.value
        elif s.name == "process_cpu_seconds_total":
            out[None] = s.value
        elif s.name == "pdserve:generation_tokens_total":
            out["tokens"] = s.value
    return out


def one_run(procs: dict, concurrency: int, num_requests: int, seed: int) -> dict:
    """µs a token per column, and the run's tokens/s, for one closed-loop run at `concurrency`."""
    before = {name: cpu_seconds(p.metrics_address) for name, p in procs.items()}
    workload = WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse(PROMPT_LEN),
                              LengthDistribution.parse(OUTPUT_LEN), tokenizer=MODEL)
    cfg = BenchConfig(target=procs["R"].address, workload=workload, rates=(float("inf"),),
                      num_requests=num_requests, max_concurrency=concurrency, seed=seed, num_warmup=0)
    (run,) = run_bench(cfg, progress=False).runs
    failed = [r.error for r in run.records if not r.is_ok]
    if failed:
        raise SystemExit(f"stream_cost: {len(failed)} requests failed: {failed[:3]}")
    after = {name: cpu_seconds(p.metrics_address) for name, p in procs.items()}
    tokens = after["R"]["tokens"] - before["R"]["tokens"]
    seconds = max(r.end_s for r in run.records) - min(r.sent_s for r in run.records)
    us = {col: 1e6 * (after[p][role] - before[p][role]) / tokens for col, (p, role) in COLUMNS.items()
          if role in after[p] and role in before[p]}
    return dict(us_per_token=us, tokens=tokens, tokens_per_s=tokens / seconds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--stream-interval", type=int, default=4, help="the second pair's decode worker's")
    ap.add_argument("--quick", action="store_true", help="one repeat, concurrency 1 and 4, few requests (a smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md (a run elsewhere than "
                    "benchmarks/results never does)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or min(args.concurrency) < 1 or args.stream_interval < 2:
        ap.error("--repeats and every --concurrency must be at least 1, --stream-interval at least 2")
    repeats, concurrencies = (1, [1, 4]) if args.quick else (args.repeats, args.concurrency)
    before_cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0} & before_cpus or before_cpus)  # beside the prefill worker and the router
    worker = ["--model", MODEL, "--num-kv-blocks", "1024", "--max-num-seqs", str(max(concurrencies))]
    intervals = [1, args.stream_interval]
    runs: dict[tuple[int, int], list[dict]] = {(i, c): [] for i in intervals for c in concurrencies}
    try:
        with tempfile.TemporaryDirectory() as tmp, Launcher(Path(tmp)) as launch:
            p = launch.worker("prefill-worker", "P", worker, [0])
            pairs = {}
            for i in intervals:
                d = launch.worker("decode-worker", f"D{i}", [*worker, "--stream-interval", str(i)], [1])
                pairs[i] = {"P": p, "D": d, "R": launch.router(f"R{i}", MODEL, [p], [d], cpus=[0])}
            launch.wait_ready()
            for procs in pairs.values():
                one_run(procs, 1, 2, seed=999)  # warm-up: first steps, first connections
            steps = [(rep, c, i) for rep in range(repeats)
                     for c in (concurrencies if rep % 2 == 0 else concurrencies[::-1])
                     for i in (intervals if rep % 2 == 0 else intervals[::-1])]
            for rep, c, i in tqdm(steps, desc="stream cost", unit="run"):
                n = 2 if args.quick else max(8, 2 * c)
                runs[i, c].append(one_run(pairs[i], c, n, seed=100 * rep + c))
    finally:
        os.sched_setaffinity(0, before_cpus)
    rows = []
    for (i, c), xs in runs.items():
        cols = {col: Spread.of(x["us_per_token"][col] for x in xs).as_dict()
                for col in COLUMNS if all(col in x["us_per_token"] for x in xs)}
        base = runs[1, c]  # the same repeat's run of the pair that streams every token
        rows.append(dict(stream_interval=i, concurrency=c, us_per_token=cols,
                         tokens_per_s=Spread.of(x["tokens_per_s"] for x in xs).as_dict(),
                         speedup=Spread.of(x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(xs, base)).as_dict()))
    result = dict(repeats=repeats, concurrency=concurrencies, stream_intervals=intervals, prompt_len=PROMPT_LEN,
                  output_len=OUTPUT_LEN, rows=rows, runs={f"{i}x{c}": v for (i, c), v in runs.items()},
                  machine=machine())
    stem = result["stem"] = "stream_cost_quick" if args.quick else "stream_cost"
    publish(result, "stream_cost", sys.argv[1:] if argv is None else argv, args.out, markdown, plot,
            None if args.quick or args.no_markdown or args.out.resolve() != RESULTS else SECTION, stem=stem)


def markdown(result: dict, command: str) -> str:
    cols = [c for c in COLUMNS if all(c in r["us_per_token"] for r in result["rows"])]
    lines = [f"Command: `{command}`. The demo target on {host(result['machine'])}: prefill worker, routers and load "
             "generator on core 0, the decode workers on core 1, single-threaded; closed loop of C requests "
             f"({result['prompt_len']} prompt tokens, {result['output_len']} greedy tokens each). CPU microseconds "
             f"per generated token by process and thread, min / median / max over {result['repeats']} repeats. The "
             "ceilings are derived (10^6 / µs a token: the tokens/s at which that thread takes a whole core), not "
             "measured. Over interval 1: a run's tokens/s over the same repeat's run of the pair that streams every "
             "token (engines and loops share this machine's two cores, so the CPU a loop saves goes to the engine).", "",
             "| stream interval | C | tokens/s | over interval 1 | " + " | ".join(f"{c}, µs" for c in cols)
             + " | ceiling: decode engine | ceiling: decode loop | ceiling: router loop |",
             "|---|---|---|---|" + "---|" * (len(cols) + 3)]
    for r in result["rows"]:
        u = r["us_per_token"]
        ceil = [f"{1e6 / u[c]['median']:,.0f}" if c in u else "-" for c in ("decode engine", "decode loop", "router loop")]
        lines.append(f"| {r['stream_interval']} | {r['concurrency']} | {fmt_spread(r['tokens_per_s'], 0)} | "
                     f"{fmt_spread(r['speedup'], 2, '×')} | "
                     + " | ".join(fmt_spread(u[c], 0) for c in cols) + " | " + " | ".join(ceil) + " |")
    stem = result.get("stem", "stream_cost")
    lines += ["", f"Files: `benchmarks/results/{stem}.json`, `benchmarks/results/{stem}.png`."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i in result["stream_intervals"]:
        rows = [r for r in result["rows"] if r["stream_interval"] == i]
        xs = [r["concurrency"] for r in rows]
        for col, colour in (("decode engine", "C0"), ("decode loop", "C1"), ("router loop", "C2")):
            if all(col in r["us_per_token"] for r in rows):
                ax.plot(xs, [r["us_per_token"][col]["median"] for r in rows], marker="o", color=colour,
                        linestyle="-" if i == 1 else "--", label=f"{col}, interval {i}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("CPU µs per generated token (median)")
    ax.set_title("Where a served token's CPU goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

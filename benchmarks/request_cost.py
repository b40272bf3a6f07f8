"""Serving cost per request: the CPU each process and thread of a served pair spends on a short
request, the fixed cost every request pays past the model.

    python benchmarks/request_cost.py [--quick] [--repeats 5] [--concurrency 1 8 32] [--engine demo|fast]

One disaggregated pair: a prefill worker, a decode worker and a router, placed as in
`stream_cost.py` (the prefill worker, the router and the load generator, this process, on core 0;
the decode worker on core 1), single-threaded. Per concurrency C, `pdserve bench` keeps C
requests of 64-token prompts and two greedy tokens in flight (closed loop), over the router's
gRPC API and, in turn, its OpenAI HTTP API, and the processes' `/metrics` are scraped around each
run: the CPU seconds of each process and of its long-lived threads, as in `stream_cost.py`, over
the requests the router finished. Two tokens, not one: a first token that ends the request ends
it at the prefill worker, before any K/V move; the second is the decode worker's, so each
request takes the whole path once (the router's parsing and admission, the decode worker's
reservation, the prefill worker's call, prefill and first token, the K/V hand-over, the decode
worker's activation and one step).

Microseconds per request, and requests/s, min / median / max over --repeats repeats, the
concurrencies and the APIs interleaved (the order reversed every repeat). The ceilings are
derived, not measured: the requests/s at which that process would take a whole core (10^6 / its
µs a request).

Writes benchmarks/results/request_cost[_fast].json and .png and the "Serving cost per request"
section of BENCHMARKS.md (or its fast-engine section; not with --quick, --no-markdown or another
--out).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from launcher import Launcher  # noqa: E402
from report import Spread, files_line, fmt_spread, host, machine  # noqa: E402
from stream_cost import (MODEL, PROMPT_LEN, closed_loop, common_args, fast_checkpoint, interleaved,  # noqa: E402
                         on_core_0, publish_run)

SECTION = "Serving cost per request (`benchmarks/request_cost.py`)"
FAST_SECTION = "Serving cost per request, a fast engine (`benchmarks/request_cost.py --engine fast`)"
OUTPUT_LEN = "fixed:2"  # the prompts are stream_cost.py's (PROMPT_LEN)
APIS = ("grpc", "http")
# what each column reads: (process, thread role or None for the whole process)
COLUMNS = {"router loop": ("R", "server"), "router process": ("R", None), "prefill engine": ("P", "engine"),
           "prefill loop": ("P", "server"), "prefill process": ("P", None), "decode engine": ("D", "engine"),
           "decode loop": ("D", "server"), "decode process": ("D", None)}
CEILINGS = ("router process", "prefill process", "decode process")


def one_run(procs: dict, concurrency: int, num_requests: int, seed: int, model: str, api: str) -> dict:
    """µs a request per column, and the run's requests/s, for one closed-loop run."""
    _, seconds, spent = closed_loop(procs, concurrency, num_requests, seed, model, OUTPUT_LEN, http=api == "http")
    us = {col: 1e6 * spent[key] / num_requests for col, key in COLUMNS.items() if key in spent}
    return dict(us_per_request=us, requests_per_s=num_requests / seconds)


def main(argv: list[str] | None = None) -> None:
    ap = common_args(__doc__)
    ap.add_argument("--requests", type=int, default=200, help="requests a run (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or min(args.concurrency) < 1 or args.requests < 2:
        ap.error("--repeats and every --concurrency must be at least 1, --requests at least 2")
    repeats, concurrencies, num = (1, [1, 4], 8) if args.quick else (args.repeats, args.concurrency, args.requests)
    runs: dict[tuple[str, int], list[dict]] = {(a, c): [] for a in APIS for c in concurrencies}
    with on_core_0(), tempfile.TemporaryDirectory() as tmp, Launcher(Path(tmp)) as launch:
        model = fast_checkpoint(Path(tmp) / "fast") if args.engine == "fast" else MODEL
        worker = ["--model", model, "--num-kv-blocks", "1024", "--max-num-seqs", str(max(concurrencies))]
        p = launch.worker("prefill-worker", "P", worker, [0])
        d = launch.worker("decode-worker", "D", worker, [1])
        procs = {"P": p, "D": d, "R": launch.router("R", model, [p], [d], cpus=[0])}
        launch.wait_ready()
        for api in APIS:  # warm-up: first steps, first connections
            one_run(procs, 1, 2, seed=999, model=model, api=api)
        for rep, c, a in tqdm(interleaved(repeats, concurrencies, list(APIS)), desc="request cost", unit="run"):
            runs[a, c].append(one_run(procs, c, num, seed=100 * rep + c, model=model, api=a))
    rows = [dict(api=a, concurrency=c, requests_per_s=Spread.of(x["requests_per_s"] for x in xs).as_dict(),
                 us_per_request={col: Spread.of(x["us_per_request"][col] for x in xs).as_dict()
                                 for col in COLUMNS if all(col in x["us_per_request"] for x in xs)})
            for (a, c), xs in runs.items()]
    result = dict(repeats=repeats, concurrency=concurrencies, requests=num, engine=args.engine, prompt_len=PROMPT_LEN,
                  output_len=OUTPUT_LEN, rows=rows, runs={f"{a}x{c}": x for (a, c), x in runs.items()},
                  machine=machine())
    publish_run("request_cost", result, args, argv, markdown, plot, (SECTION, FAST_SECTION))


def markdown(result: dict, command: str) -> str:
    cols = [c for c in COLUMNS if all(c in r["us_per_request"] for r in result["rows"])]
    engine = ("The demo target" if result["engine"] == "demo" else
              "A random two-layer model of the demo's vocabulary (its prefill and step next to nothing)")
    lines = [f"Command: `{command}`. {engine} on {host(result['machine'])}: prefill worker, router and load "
             "generator on core 0, the decode worker on core 1, single-threaded; closed loop of C requests "
             f"({result['prompt_len']} prompt tokens, {result['output_len']} greedy tokens each), {result['requests']} "
             "a run, over the router's gRPC API and its OpenAI HTTP API in turn. CPU microseconds per request by "
             f"process and thread, and requests/s, min / median / max over {result['repeats']} repeats. A process's "
             "CPU clock counts 10 ms ticks, its threads' nanoseconds. The ceilings are derived (10^6 / µs a request: "
             "the requests/s at which that process takes a whole core), not measured.", "",
             "| API | C | requests/s | " + " | ".join(f"{c}, µs" for c in cols) + " | "
             + " | ".join(f"ceiling: {c}" for c in CEILINGS) + " |",
             "|---|---|---|" + "---|" * (len(cols) + len(CEILINGS))]
    for r in result["rows"]:
        u = r["us_per_request"]
        ceil = [f"{1e6 / u[c]['median']:,.0f}" if u.get(c, {}).get("median") else "-" for c in CEILINGS]
        lines.append(f"| {r['api']} | {r['concurrency']} | {fmt_spread(r['requests_per_s'], 0)} | "
                     + " | ".join(fmt_spread(u[c], 0) for c in cols) + " | " + " | ".join(ceil) + " |")
    stem = result.get("stem", "request_cost")
    lines += files_line(stem)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for a, style in zip(APIS, ("-", "--")):
        rows = [r for r in result["rows"] if r["api"] == a]
        xs = [r["concurrency"] for r in rows]
        for col, colour in zip(CEILINGS, ("C2", "C0", "C1")):
            if all(col in r["us_per_request"] for r in rows):
                ax.plot(xs, [r["us_per_request"][col]["median"] / 1e3 for r in rows], marker="o", color=colour,
                        linestyle=style, label=f"{col}, {a}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("CPU ms per request (median)")
    ax.set_title(f"What a request costs past the model ({result['engine']} engine)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""Streaming cost per token: the CPU each thread of a served pair spends on one generated token.

    python benchmarks/stream_cost.py [--quick] [--repeats 5] [--concurrency 1 8 32] [--stream-interval 4]
                                     [--engine demo|fast]

Four disaggregated pairs over one prefill worker, each with its own decode worker and router: one
as both start by default (every token streamed as the engine emits it, on the router's token
stream to the decode worker, a message a step for all its requests; a stream that fell behind its
engine sends what waits as one message), one with `--stream-interval N` (a request's tokens once N
are new, its first and last at once), one with `--no-merge-backlog` (a message per engine output
however far behind: what the merge saves), and one whose router runs with `--no-token-streams`
("1, own calls": each request's tokens on its own call, a message per request and output); the default pair is
measured a second time with its clients on the router's OpenAI HTTP API ("1, HTTP": each delta a
server-sent event) instead of its gRPC stream. The prefill worker and the routers on core 0, the
decode workers on core 1 (a worker's engine thread and its serving loop share that core, as in
any one-process worker), single-threaded; the load generator (this process) on core 0. Only one
pair has requests at a time. Per concurrency C, `pdserve bench` keeps C requests of 64-token
prompts and 128 greedy tokens in flight (closed loop), and the workers' and router's `/metrics`
are scraped around it: the CPU seconds of each process (`process_cpu_seconds_total`) and of its
long-lived threads (`pdserve:thread_cpu_seconds_total`: the engine thread, the serving loop,
grpc.aio's poller), over the tokens the router sent
(`pdserve:generation_tokens_total`). Microseconds per token, and the tokens a message carried to
the client, min / median / max over --repeats repeats, the concurrencies and the pairs interleaved
(the order reversed every repeat).

--engine demo serves the demo target, whose step on this CPU is slow beside the loops. --engine
fast serves a random two-layer model of the demo's vocabulary and tokenizer (built at start, its
output noise): an engine whose step is cheap beside its serving loops, as a GPU's is at large
batches, so the loops, not the model, bound what the pair serves.

The decode worker's engine thread gets cheaper per token as the batch grows; the router's serving
loop, which writes a gRPC message per request and output to the clients, does not, nor does the
decode worker's where it writes one per request and output too (a router with --no-token-streams;
on a token stream it writes a message a step for all the router's requests). The last columns are derived, not measured: the tokens/s at which
each loop would take a whole core (10^6 / its µs a token) beside the engine's (the same for the
engine thread): where a loop's is the lower, the loop, not the model, caps what the process can
serve, whatever the accelerator does.

Writes benchmarks/results/stream_cost[_fast].json and .png and the "Streaming cost per token"
section of BENCHMARKS.md (or its fast-engine section; not with --quick, --no-markdown or another
--out).
"""
from __future__ import annotations

import argparse
import contextlib
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
from report import Spread, files_line, fmt_spread, host, machine, publish  # noqa: E402
RESULTS = REPO / "benchmarks" / "results"
SECTION = "Streaming cost per token (`benchmarks/stream_cost.py`)"
FAST_SECTION = "Streaming cost per token, an engine fast beside its loops (`benchmarks/stream_cost.py --engine fast`)"
MODEL = str(REPO / "models" / "demo")
# the variants' labels beside "N" (--stream-interval N); HTTP: the default pair, its clients on the OpenAI API
DEFAULT, UNMERGED, OWN_CALLS, HTTP = "1", "1, unmerged", "1, own calls", "1, HTTP"
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


def fast_checkpoint(path: Path) -> str:
    """A random two-layer Llama with the demo's vocabulary and tokenizer, saved at `path`: a step
    far cheaper than the demo target's, whose output is noise (only what it costs is read)."""
    import shutil

    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(MODEL)
    config.update(dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for f in Path(MODEL).glob("tokenizer*"):
        shutil.copy(f, path)
    return str(path)


def closed_loop(procs: dict, concurrency: int, num_requests: int, seed: int, model: str, output_len: str,
                http: bool = False, connections: int = 1) -> tuple[list, float, dict]:
    """One closed-loop run of `pdserve bench` at `concurrency` through the router procs["R"] (http:
    on its OpenAI API, each delta a server-sent event, instead of its gRPC stream): the records,
    the seconds from the first sent to the last ended, and what each process spent over the run,
    read from its /metrics before and after (`cpu_seconds`): {(process, thread role): CPU
    seconds}, the whole process's under role None, the router's generated tokens under ("R",
    "tokens"). gRPC requests take `connections` connections in turn. A failed request ends the
    benchmark."""
    before = {name: cpu_seconds(p.metrics_address) for name, p in procs.items()}
    workload = WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse(PROMPT_LEN),
                              LengthDistribution.parse(output_len), tokenizer=model)
    api = dict(http_url=f"http://{procs['R'].http_address}") if http else dict(target=procs["R"].address)
    cfg = BenchConfig(workload=workload, rates=(float("inf"),), num_requests=num_requests,
                      max_concurrency=concurrency, seed=seed, num_warmup=0, connections=connections, **api)
    (run,) = run_bench(cfg, progress=False).runs
    failed = [r.error for r in run.records if not r.is_ok]
    if failed:
        raise SystemExit(f"closed loop: {len(failed)} requests failed: {failed[:3]}")
    after = {name: cpu_seconds(p.metrics_address) for name, p in procs.items()}
    seconds = max(r.end_s for r in run.records) - min(r.sent_s for r in run.records)
    spent = {(name, role): after[name][role] - before[name][role] for name in procs for role in after[name]
             if role in before[name]}
    return run.records, seconds, spent


def one_run(procs: dict, concurrency: int, num_requests: int, seed: int, model: str = MODEL,
            http: bool = False) -> dict:
    """µs a token per column, the run's tokens/s and the tokens a message carried to the client,
    for one closed-loop run at `concurrency` (`closed_loop`)."""
    records, seconds, spent = closed_loop(procs, concurrency, num_requests, seed, model, OUTPUT_LEN, http)
    tokens = spent["R", "tokens"]
    us = {col: 1e6 * spent[key] / tokens for col, key in COLUMNS.items() if key in spent}
    messages = sum(len(r.delta_tokens) for r in records)
    return dict(us_per_token=us, tokens=tokens, tokens_per_s=tokens / seconds,
                tokens_per_message=sum(r.num_output_tokens for r in records) / messages)


def common_args(doc: str) -> argparse.ArgumentParser:
    """The options this script and request_cost.py share."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--engine", choices=["demo", "fast"], default="demo", help="the demo target, or a random "
                    "two-layer model whose prefill and step are cheap beside the serving loops")
    ap.add_argument("--quick", action="store_true", help="one repeat, concurrency 1 and 4, few requests (a smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md (a run elsewhere than "
                    "benchmarks/results never does)")
    return ap


@contextlib.contextmanager
def on_core_0():
    """This process (the load generator) on core 0, beside the prefill worker and the router."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0} & before or before)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def interleaved(repeats: int, concurrencies: list[int], variants: list) -> list[tuple]:
    """(repeat, concurrency, variant) in run order, the order reversed every other repeat."""
    return [(rep, c, v) for rep in range(repeats) for c in (concurrencies if rep % 2 == 0 else concurrencies[::-1])
            for v in (variants if rep % 2 == 0 else variants[::-1])]


def main(argv: list[str] | None = None) -> None:
    ap = common_args(__doc__)
    ap.add_argument("--stream-interval", type=int, default=4, help="the second pair's decode worker's")
    args = ap.parse_args(argv)
    if args.repeats < 1 or min(args.concurrency) < 1 or args.stream_interval < 2:
        ap.error("--repeats and every --concurrency must be at least 1, --stream-interval at least 2")
    repeats, concurrencies = (1, [1, 4]) if args.quick else (args.repeats, args.concurrency)
    # (the decode worker's options, the router's); None: the default pair's processes
    variants = {DEFAULT: ([], []), str(args.stream_interval): (["--stream-interval", str(args.stream_interval)], []),
                UNMERGED: (["--no-merge-backlog"], []), OWN_CALLS: ([], ["--no-token-streams"]), HTTP: None}
    runs: dict[tuple[str, int], list[dict]] = {(v, c): [] for v in variants for c in concurrencies}
    with on_core_0(), tempfile.TemporaryDirectory() as tmp, Launcher(Path(tmp)) as launch:
        model = fast_checkpoint(Path(tmp) / "fast") if args.engine == "fast" else MODEL
        worker = ["--model", model, "--num-kv-blocks", "1024", "--max-num-seqs", str(max(concurrencies))]
        p = launch.worker("prefill-worker", "P", worker, [0])
        pairs = {}
        for n, (v, extra) in enumerate(variants.items()):
            if extra is not None:
                d = launch.worker("decode-worker", f"D{n}", [*worker, *extra[0]], [1])
                pairs[v] = {"P": p, "D": d, "R": launch.router(f"R{n}", model, [p], [d], cpus=[0], extra=extra[1])}
        pairs[HTTP] = pairs[DEFAULT]
        launch.wait_ready()
        for v, procs in pairs.items():  # warm-up: first steps, first connections
            one_run(procs, 1, 2, seed=999, model=model, http=v == HTTP)
        for rep, c, v in tqdm(interleaved(repeats, concurrencies, list(variants)), desc="stream cost", unit="run"):
            n = 2 if args.quick else max(8, 2 * c)
            runs[v, c].append(one_run(pairs[v], c, n, seed=100 * rep + c, model=model, http=v == HTTP))
    rows = []
    for (v, c), xs in runs.items():
        cols = {col: Spread.of(x["us_per_token"][col] for x in xs).as_dict()
                for col in COLUMNS if all(col in x["us_per_token"] for x in xs)}
        base = runs[DEFAULT, c]  # the same repeat's run of the pair as a decode worker starts
        rows.append(dict(variant=v, stream_interval=1 if v in (DEFAULT, UNMERGED, OWN_CALLS, HTTP) else args.stream_interval,
                         merge_backlog=v != UNMERGED, token_streams=v != OWN_CALLS, api="http" if v == HTTP else "grpc",
                         concurrency=c,
                         us_per_token=cols,
                         tokens_per_s=Spread.of(x["tokens_per_s"] for x in xs).as_dict(),
                         tokens_per_message=Spread.of(x["tokens_per_message"] for x in xs).as_dict(),
                         speedup=Spread.of(x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(xs, base)).as_dict()))
    result = dict(repeats=repeats, concurrency=concurrencies, variants=list(variants), engine=args.engine,
                  prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, rows=rows,
                  runs={f"{v}x{c}": x for (v, c), x in runs.items()}, machine=machine())
    publish_run("stream_cost", result, args, argv, markdown, plot, (SECTION, FAST_SECTION))


def publish_run(name: str, result: dict, args, argv: list[str] | None, markdown, plot, sections: tuple[str, str]):
    """`report.publish` for a run of `common_args`: its files under a stem that says the engine and
    a quick run, and (a full run into benchmarks/results) its section, the demo target's or the
    fast engine's."""
    stem = result["stem"] = name + ("_fast" if args.engine == "fast" else "") + ("_quick" if args.quick else "")
    writes_markdown = not (args.quick or args.no_markdown or args.out.resolve() != RESULTS)
    section = sections[args.engine == "fast"] if writes_markdown else None
    publish(result, name, sys.argv[1:] if argv is None else argv, args.out, markdown, plot, section, stem=stem)


def markdown(result: dict, command: str) -> str:
    cols = [c for c in COLUMNS if all(c in r["us_per_token"] for r in result["rows"])]
    engine = ("the demo target" if result.get("engine", "demo") == "demo" else
              "a random two-layer model of the demo's vocabulary (a step cheap beside the loops)")
    lines = [f"Command: `{command}`. {engine[0].upper() + engine[1:]} on {host(result['machine'])}: prefill worker, "
             "routers and load generator on core 0, the decode workers on core 1, single-threaded; closed loop of C "
             f"requests ({result['prompt_len']} prompt tokens, {result['output_len']} greedy tokens each). The decode "
             "workers: as started by default (\"1\": every token streamed on the router's token stream, a message a step "
             "for all its requests, a backlog merged), with --stream-interval N (\"N\"), and with --no-merge-backlog "
             "(\"1, unmerged\": a message per engine output); \"1, own calls\": the default decode worker behind a router "
             "with --no-token-streams (each request's tokens on its own call); \"1, HTTP\": the "
             "default pair with the load on the OpenAI HTTP API (server-sent events) instead of gRPC. CPU microseconds "
             f"per generated token by process and thread, min / median / max over {result['repeats']} repeats. The "
             "ceilings are derived (10^6 / µs a token: the tokens/s at which that thread takes a whole core), not "
             "measured. Over the default: a run's tokens/s over the same repeat's run of the default pair (engines "
             "and loops share this machine's two cores, so the CPU a loop saves goes to the engine).", "",
             "| decode worker | C | tokens/s | over the default | tokens a message | "
             + " | ".join(f"{c}, µs" for c in cols) + " | ceiling: decode engine | ceiling: decode loop | "
             "ceiling: router loop |",
             "|---|---|---|---|---|" + "---|" * (len(cols) + 3)]
    for r in result["rows"]:
        u = r["us_per_token"]
        ceil = [f"{1e6 / u[c]['median']:,.0f}" if c in u else "-" for c in ("decode engine", "decode loop", "router loop")]
        lines.append(f"| {r['variant']} | {r['concurrency']} | {fmt_spread(r['tokens_per_s'], 0)} | "
                     f"{fmt_spread(r['speedup'], 2, '×')} | {fmt_spread(r['tokens_per_message'], 2)} | "
                     + " | ".join(fmt_spread(u[c], 0) for c in cols) + " | " + " | ".join(ceil) + " |")
    stem = result.get("stem", "stream_cost")
    lines += files_line(stem)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    styles = dict(zip(result["variants"], ("-", "--", ":", (0, (5, 1, 1, 1)), "-.")))
    for v in result["variants"]:
        rows = [r for r in result["rows"] if r["variant"] == v]
        xs = [r["concurrency"] for r in rows]
        for col, colour in (("decode engine", "C0"), ("decode loop", "C1"), ("router loop", "C2")):
            if all(col in r["us_per_token"] for r in rows):
                ax.plot(xs, [r["us_per_token"][col]["median"] for r in rows], marker="o", color=colour,
                        linestyle=styles[v], label=f"{col}, {v}")
        bx.plot(xs, [r["tokens_per_s"]["median"] for r in rows], marker="o", linestyle=styles[v], label=v)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("requests in flight")
        a.legend(fontsize=7)
    ax.set_ylabel("CPU µs per generated token (median)")
    ax.set_title("Where a served token's CPU goes")
    bx.set_ylabel("tokens/s (median)")
    bx.set_title(f"Served tokens/s ({result.get('engine', 'demo')} engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""Router processes: one router against two sharing its port, in front of the same workers.

    python benchmarks/router_processes.py [--quick] [--repeats 5] [--concurrency 32 64] [--engine fast|demo]
                                          [--connections 16]

One prefill and one decode worker (prefill on core 0, decode on core 1, single-threaded, as in
`stream_cost.py`), and two front ends for them, each measured in turn: one router alone ("1
router"), and two routers sharing one gRPC and one HTTP port (`pdserve router --reuse-port`, as
`router.processes: 2` runs them; "2 routers"), the kernel spreading connections over them. The
routers are not pinned: the kernel places them on either core. Per concurrency C, `pdserve bench`
(this process, on core 0) keeps C requests of 64-token prompts and 128 greedy tokens in flight
(closed loop) over --connections gRPC connections, each its own. Each router's `/metrics` is
scraped around each run: its CPU seconds and the tokens it sent.

Reported, min / median / max over --repeats repeats (the concurrencies and front ends
interleaved, the order reversed every repeat): tokens/s; the two routers' tokens/s over the same
repeat's single router; the routers' CPU microseconds per token, all routers together; and the
busiest router's share of the tokens (0.5: an even split). The default engine is the fast one (a
random two-layer model of the demo's vocabulary, its step cheap beside the serving loops), the
case in which the routers' loops, not the model, bound what the pair serves.

On a host of two cores there is no idle core for a second router to use: the comparison says
what splitting the front end costs or gains there, and how evenly the connections spread; the
ceilings a router per core gives on a larger host are derived from the µs a token (10^6 / µs),
not measured.

Writes benchmarks/results/router_processes[_fast].json and .png and the "Router processes"
section of BENCHMARKS.md (its fast-engine or demo section; not with --quick, --no-markdown or
another --out).
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
from stream_cost import MODEL, OUTPUT_LEN, PROMPT_LEN, closed_loop, common_args, fast_checkpoint, interleaved, \
    on_core_0, publish_run  # noqa: E402

SECTION = "Router processes, the demo target (`benchmarks/router_processes.py --engine demo`)"
FAST_SECTION = "Router processes (`benchmarks/router_processes.py`)"
ONE, TWO = "1 router", "2 routers"


def one_run(procs: dict, routers: list[str], concurrency: int, num_requests: int, seed: int, model: str,
            connections: int) -> dict:
    """tokens/s, the routers' CPU µs a token and a message together, the tokens a message carried to
    the client, and the busiest router's share of the tokens."""
    records, seconds, spent = closed_loop(procs, concurrency, num_requests, seed, model, OUTPUT_LEN,
                                          connections=connections)
    tokens = [spent[r, "tokens"] for r in routers]
    cpu = sum(spent[r, None] for r in routers)
    messages = sum(len(r.delta_tokens) for r in records)
    return dict(tokens_per_s=sum(tokens) / seconds, busiest_share=max(tokens) / sum(tokens),
                router_us_per_token=1e6 * cpu / sum(tokens), router_us_per_message=1e6 * cpu / messages,
                tokens_per_message=sum(r.num_output_tokens for r in records) / messages)


def main(argv: list[str] | None = None) -> None:
    ap = common_args(__doc__)
    ap.set_defaults(engine="fast", concurrency=[32, 64])
    ap.add_argument("--connections", type=int, default=16, help="gRPC connections of the load generator")
    args = ap.parse_args(argv)
    if args.repeats < 1 or min(args.concurrency) < 1 or args.connections < 2:
        ap.error("--repeats and every --concurrency must be at least 1, --connections at least 2")
    repeats, concurrencies = (1, [4]) if args.quick else (args.repeats, args.concurrency)
    runs: dict[tuple[str, int], list[dict]] = {(v, c): [] for v in (ONE, TWO) for c in concurrencies}
    with on_core_0(), tempfile.TemporaryDirectory() as tmp, Launcher(Path(tmp)) as launch:
        model = fast_checkpoint(Path(tmp) / "fast") if args.engine == "fast" else MODEL
        worker = ["--model", model, "--num-kv-blocks", "1024", "--max-num-seqs", str(max(concurrencies))]
        p = launch.worker("prefill-worker", "P", worker, [0])
        d = launch.worker("decode-worker", "D", worker, [1])
        alone = launch.router("R", model, [p], [d])
        first = launch.router("R1", model, [p], [d], extra=["--reuse-port"])
        first.wait_ready()
        shared = ["--reuse-port", "--port", first.address.rsplit(":", 1)[1], "--http-port",
                  first.http_address.rsplit(":", 1)[1]]
        second = launch.router("R2", model, [p], [d], extra=shared)
        launch.wait_ready()
        fronts = {ONE: ({"P": p, "D": d, "R": alone}, ["R"]), TWO: ({"P": p, "D": d, "R": first, "R2": second},
                                                                    ["R", "R2"])}
        for v, (procs, routers) in fronts.items():  # warm-up: first steps, every connection
            one_run(procs, routers, args.connections, 2 * args.connections, 999, model, args.connections)
        for rep, c, v in tqdm(interleaved(repeats, concurrencies, [ONE, TWO]), desc="router processes", unit="run"):
            n = args.connections if args.quick else 2 * c  # a quick run still takes every connection
            runs[v, c].append(one_run(*fronts[v], c, n, seed=100 * rep + c, model=model,
                                      connections=args.connections))
    rows = []
    for (v, c), xs in runs.items():
        base = runs[ONE, c]
        rows.append(dict(front=v, concurrency=c, tokens_per_s=Spread.of(x["tokens_per_s"] for x in xs).as_dict(),
                         speedup=Spread.of(x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(xs, base)).as_dict(),
                         router_us_per_token=Spread.of(x["router_us_per_token"] for x in xs).as_dict(),
                         router_us_per_message=Spread.of(x["router_us_per_message"] for x in xs).as_dict(),
                         tokens_per_message=Spread.of(x["tokens_per_message"] for x in xs).as_dict(),
                         busiest_share=Spread.of(x["busiest_share"] for x in xs).as_dict()))
    result = dict(repeats=repeats, concurrency=concurrencies, connections=args.connections, engine=args.engine,
                  prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, rows=rows,
                  runs={f"{v}x{c}": x for (v, c), x in runs.items()}, machine=machine())
    publish_run("router_processes", result, args, argv, markdown, plot, (SECTION, FAST_SECTION))


def markdown(result: dict, command: str) -> str:
    engine = ("the demo target" if result["engine"] == "demo" else
              "a random two-layer model of the demo's vocabulary (a step cheap beside the loops)")
    lines = [f"Command: `{command}`. {engine[0].upper() + engine[1:]} on {host(result['machine'])}: prefill worker "
             "and load generator on core 0, decode worker on core 1, single-threaded, the routers unpinned; closed "
             f"loop of C requests ({result['prompt_len']} prompt tokens, {result['output_len']} greedy tokens each) "
             f"over {result['connections']} gRPC connections. \"2 routers\": two `pdserve router --reuse-port` on one "
             "port (what `router.processes: 2` runs). Min / median / max over "
             f"{result['repeats']} repeats; over one router: a run's tokens/s over the same repeat's run with one "
             "router. Routers' µs a token (a message): their CPU together over the tokens they sent (the messages the "
             "client received). Tokens a message: as the client received them (a decode worker merges what waits for a "
             "stream that fell behind; a router sends each message on as one). Busiest router's share: of "
             "the tokens (0.5 is an even split). The ceiling is derived, not measured: the tokens/s at which "
             "the routers would take a whole core each (n × 10^6 / their µs a token, n routers sharing the tokens; "
             "a host with a core to spare for each).", "",
             "| front end | C | tokens/s | over one router | tokens a message | routers' µs a token | "
             "routers' µs a message | busiest router's share | ceiling, a core a router |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ceiling = (2 if r["front"] == TWO else 1) * 1e6 / r["router_us_per_token"]["median"]
        lines.append(f"| {r['front']} | {r['concurrency']} | {fmt_spread(r['tokens_per_s'], 0)} | "
                     f"{fmt_spread(r['speedup'], 2, '×')} | {fmt_spread(r['tokens_per_message'], 2)} | "
                     f"{fmt_spread(r['router_us_per_token'], 0)} | {fmt_spread(r['router_us_per_message'], 0)} | "
                     f"{fmt_spread(r['busiest_share'], 2)} | {ceiling:,.0f} |")
    stem = result.get("stem", "router_processes")
    lines += files_line(stem)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for v, style in ((ONE, "-"), (TWO, "--")):
        rows = [r for r in result["rows"] if r["front"] == v]
        xs = [r["concurrency"] for r in rows]
        ax.errorbar(xs, [r["tokens_per_s"]["median"] for r in rows],
                    yerr=[[r["tokens_per_s"]["median"] - r["tokens_per_s"]["min"] for r in rows],
                          [r["tokens_per_s"]["max"] - r["tokens_per_s"]["median"] for r in rows]],
                    marker="o", linestyle=style, capsize=3, label=v)
        bx.plot(xs, [r["router_us_per_token"]["median"] for r in rows], marker="o", linestyle=style, label=v)
    for a in (ax, bx):
        a.set_xlabel("requests in flight")
        a.legend(fontsize=8)
    ax.set_ylabel("tokens/s (min / median / max)")
    ax.set_title(f"Served tokens/s ({result['engine']} engine)")
    bx.set_ylabel("routers' CPU µs per token (median)")
    bx.set_title("What the routers spend a token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""How far processes of one configuration differ: the noise floor under `spec_decode.py`'s ratios.

    python benchmarks/process_spread.py [--processes 4] [--rounds 8] [--batch-sizes 1 32]

`spec_decode.py` runs each configuration's engine in a process of its own and divides a method's
run by plain decoding's runs beside it. Its control row, plain decoding in a second process
measured like a method, moved from run to run of the same command on the same revision (its
median at batch 32, greedy, 1.16x in one run and 0.98x in the next): some of what separates a
method from plain decoding is which process each landed in. This measures that alone: the same
plain engine (spec_decode's tuned options) in --processes processes, started one after another,
each answering the same greedy 128-token batch in turn, round after round (the order reversing
every round, so no process always follows the same one). Per batch size: each process's median
seconds, and the spread, the slowest process's median over the fastest's; a ratio between
processes that the host's drift alone, averaged over the rounds, would bring close to 1.
Writes JSON and a PNG under benchmarks/results/ and its section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from tqdm import tqdm  # noqa: E402

from prompts import code_prompts  # noqa: E402
from report import Spread, host, machine, publish  # noqa: E402
import spec_decode  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SECTION = "Processes of one configuration (the noise floor under speculation's ratios)"


def measure(processes: int, rounds: int, batch_sizes: list[int], max_tokens: int = 128,
            tuned: dict | None = None, progress: bool = True) -> dict:
    """Per batch size: each process's run seconds over the rounds, and their medians' spread."""
    from pdserve.engine.tokenizer import Tokenizer

    model, draft = str(REPO / "models" / "demo"), str(REPO / "models" / "demo-draft")
    max_b = max(batch_sizes)
    setup = spec_decode.Setup.of(model, draft, max_b, max_tokens,
                                 tuned if tuned is not None else {"graph_capture": "compile"}, threads=1)
    prompts = code_prompts(Tokenizer.from_dir(model), max_b)
    plain = spec_decode.METHODS[0]
    engines = []
    try:
        for _ in tqdm(range(processes), desc="process_spread: engines", unit="engine", disable=not progress):
            engines.append(spec_decode.start_engine(plain, setup))
        rows = []
        with tqdm(total=len(batch_sizes) * (rounds + 1) * processes, desc="process_spread", unit="gen",
                  disable=not progress) as bar:
            for b in batch_sizes:
                params = dict(temperature=0, max_tokens=max_tokens, ignore_eos=True, seed=b)
                ask = lambda e: e.ask(dict(prompts=prompts[:b], params=params))["seconds"]  # noqa: E731
                for e in engines:  # each process's first run at this batch size: not timed
                    ask(e)
                    bar.update(1)
                seconds: list[list[float]] = [[] for _ in engines]
                for r in range(rounds):
                    for i in (range(processes) if r % 2 == 0 else reversed(range(processes))):
                        seconds[i].append(ask(engines[i]))
                        bar.update(1)
                medians = [statistics.median(s) for s in seconds]
                rows.append(dict(batch_size=b, seconds=[Spread.of(s).as_dict() for s in seconds],
                                 spread=max(medians) / min(medians),
                                 fastest=medians.index(min(medians)), slowest=medians.index(max(medians))))
    finally:
        for e in engines:
            e.close()
    return dict(rows=rows, processes=processes, rounds=rounds, max_tokens=max_tokens, tuned_options=setup.tuned)


def markdown(result: dict, command: str) -> str:
    m = result["machine"]
    lines = [f"Command: `{command}` ({result['processes']} processes of plain decoding, the same options as "
             f"`spec_decode.py`'s tuned ones ({result['tuned_options']}, one torch thread), started one after "
             f"another; {result['rounds']} rounds, each process answering the same greedy {result['max_tokens']}-token "
             f"batch in turn, the order reversed every round; {host(m)}; load average (1 min) at the start and end "
             f"{m['load_avg_1m_start']:.2f}, {m['load_avg_1m_end']:.2f}).", "",
             "| batch | run seconds per process, in start order (min / median / max) | slowest median / fastest |",
             "|---|---|---|"]
    for r in result["rows"]:
        per = "<br>".join(f"{i + 1}: {Spread.from_dict(s).fmt(3)}" for i, s in enumerate(r["seconds"]))
        lines.append(f"| {r['batch_size']} | {per} | {r['spread']:.3f}× |")
    return "\n".join(lines + ["", "Files: `benchmarks/results/process_spread.json`, "
                              "`benchmarks/results/process_spread.png`."])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.5), squeeze=False)
    for ax, r in zip(axes[0], rows):
        spreads = [Spread.from_dict(s) for s in r["seconds"]]
        low = min(s.median for s in spreads)
        xs = range(1, len(spreads) + 1)
        ax.errorbar(xs, [s.median / low for s in spreads],
                    yerr=[[(s.median - s.min) / low for s in spreads], [(s.max - s.median) / low for s in spreads]],
                    fmt="o", capsize=3)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xlabel("process (start order)")
        ax.set_title(f"batch {r['batch_size']}: run seconds / fastest median")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--no-markdown", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    if args.processes < 2 or args.rounds < 1 or min(args.batch_sizes) < 1:
        ap.error("--processes must be at least 2, --rounds and every batch size at least 1")
    start = machine()
    result = measure(args.processes, args.rounds, args.batch_sizes)
    end = machine()
    result["machine"] = start | dict(load_avg_1m_start=start["load_avg_1m"], load_avg_1m_end=end["load_avg_1m"])
    publish(result, "process_spread", sys.argv[1:], RESULTS, markdown, plot, None if args.no_markdown else SECTION)


if __name__ == "__main__":
    main()

"""Disaggregated against colocated TTFT at low load, measured by `pdserve bench` side by side.

    python benchmarks/ttft_low_load.py [--quick] [--repeats 5] [--num-requests 20]

Two systems run at once, each with single-threaded workers pinned to cores:

    disagg      router -> prefill worker (core 0) -> decode worker (core 1)
    colocated   router -> one decode worker that prefills for itself (core 0)

One request at a time (`pdserve bench --max-concurrency 1`), so the arms never compete: TTFT
is the prompt's prefill plus each arm's own hops. In the disaggregated arm those are the
reservation on the decode worker, the prefill call, and the first token's way back: the
prefill worker answers it as soon as it samples it, while its K/V are still on their way to
the decode worker. Repeats alternate the arms' order; each repeat's ratio is
median TTFT disagg / median TTFT colocated. Goal: every repeat <= 1.10.

Writes benchmarks/results/ttft_low_load.json and .png and the "TTFT at low load" section of
BENCHMARKS.md (not with --quick).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from launcher import Launcher
from report import GOAL_HEADER, Goal, Spread, machine, update_section
from tqdm import tqdm

from pdserve.loadgen.bench import BenchConfig, run_bench
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = str(REPO / "models" / "demo")
WORKER = ["--model", MODEL, "--num-kv-blocks", "512", "--max-num-seqs", "8"]
PROMPT_LEN, OUTPUT_LEN = "uniform:256,768", "fixed:8"


def workload() -> WorkloadConfig:
    return WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse(PROMPT_LEN),
                          LengthDistribution.parse(OUTPUT_LEN), tokenizer=MODEL)


def start(run: Launcher) -> dict[str, str]:
    prefill = run.worker("prefill-worker", "disagg-P", WORKER, [0])
    decode = run.worker("decode-worker", "disagg-D", WORKER, [1])
    colocated = run.worker("decode-worker", "colocated-D", WORKER, [0])
    routers = {"disagg": run.router("disagg-R", MODEL, [prefill], [decode]),
               "colocated": run.router("colocated-R", MODEL, [], [colocated])}
    run.wait_ready()
    return {arm: r.address for arm, r in routers.items()}


def ttft(address: str, num: int, seed: int) -> dict:
    cfg = BenchConfig(target=address, workload=workload(), rates=(float("inf"),), num_requests=num,
                      max_concurrency=1, seed=seed, num_warmup=2)
    (s,) = run_bench(cfg, progress=False).summaries()
    return {"ttft_p50_s": s.ttft.p50, "ttft_p90_s": s.ttft.p90, "tpot_p50_s": s.tpot.p50}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 repeats of 4 requests: checks the script works")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-requests", type=int, default=20, help="per arm and repeat")
    p.add_argument("--out", default=str(RESULTS / "ttft_low_load"))
    args = p.parse_args()
    if args.quick:
        args.repeats, args.num_requests = 2, 4
    runs = []
    with tempfile.TemporaryDirectory() as logs, Launcher(Path(logs)) as run:
        arms = start(run)
        for r in tqdm(range(args.repeats), desc="repeats", unit="repeat"):
            order = ["disagg", "colocated"] if r % 2 == 0 else ["colocated", "disagg"]
            # the same prompts in both arms of a repeat (the seed picks them), new ones each repeat
            runs.append({arm: ttft(arms[arm], args.num_requests, seed=r) for arm in order})
    ratio = Spread.of(rep["disagg"]["ttft_p50_s"] / rep["colocated"]["ttft_p50_s"] for rep in runs)
    goal = Goal("disaggregated TTFT / colocated TTFT at low load (median per repeat)", ratio, 1.10, is_floor=False)
    result = {"repeats": runs, "goal": goal.as_dict(), "machine": machine(),
              "workload": {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN}, "config": vars(args)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(runs, out.with_suffix(".png"))
    body = markdown(runs, goal, args)
    print(body)
    if not args.quick:
        update_section(REPO / "BENCHMARKS.md", "TTFT at low load (`benchmarks/ttft_low_load.py`)", body)


def markdown(runs: list[dict], goal: Goal, args) -> str:
    ms = lambda arm, key: Spread.of(rep[arm][key] * 1e3 for rep in runs)  # noqa: E731
    lines = [f"Command: `PYTHONPATH=benchmarks .venv/bin/python benchmarks/ttft_low_load.py --repeats "
             f"{args.repeats} --num-requests {args.num_requests}`, through `pdserve bench` "
             f"(`--max-concurrency 1`), prompts {PROMPT_LEN} tokens of code, {OUTPUT_LEN} output tokens, "
             "demo target, one torch thread per worker, workers pinned (disagg: prefill core 0, decode core 1; "
             "colocated: one worker on core 0), default worker settings otherwise. Output: "
             "`benchmarks/results/ttft_low_load.json`, `.png`.", "",
             "| arm | TTFT p50 (ms), min / median / max over repeats | TTFT p90 (ms) | TPOT p50 (ms) |",
             "|---|---|---|---|"]
    for arm in ("disagg", "colocated"):
        lines.append(f"| {arm} | {ms(arm, 'ttft_p50_s').fmt(1)} | {ms(arm, 'ttft_p90_s').fmt(1)} | "
                     f"{ms(arm, 'tpot_p50_s').fmt(2)} |")
    lines += ["", *GOAL_HEADER, goal.row(), "",
              "The first token leaves the prefill worker as soon as it is sampled (`PrefillStream`), so "
              "the K/V transfer and the decode worker's activation are off the TTFT path; what remains "
              "over colocated is the reservation call on the decode worker before the prefill call."]
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, arm in enumerate(("disagg", "colocated")):
        ax.plot(range(1, len(runs) + 1), [rep[arm]["ttft_p50_s"] * 1e3 for rep in runs], "o-", color=f"C{i}",
                label=arm)
    ax.set_xlabel("repeat")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("TTFT at low load, one request at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

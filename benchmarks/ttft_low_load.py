"""Disaggregated against colocated TTFT at low load, measured by `pdserve bench` side by side.

    python benchmarks/ttft_low_load.py [--quick] [--repeats 5] [--num-requests 20] [--no-kv-shm] [--draft]

Two systems run at once, each with single-threaded workers pinned to cores:

    disagg      router -> prefill worker (core 0) -> decode worker (core 1)
    colocated   router -> one decode worker that prefills for itself (core 0)

One request at a time (`pdserve bench --max-concurrency 1`), so the arms never compete: TTFT
is the prompt's prefill plus each arm's own hops. In the disaggregated arm those are the
reservation on the decode worker, the prefill call, and the first token's way back: the
prefill worker answers it as soon as it samples it, while its K/V are still on their way to
the decode worker. Within a repeat the arms take turns every `--block` requests, on the same
prompts, so noise from the rest of this shared machine lands on both. Each repeat's ratio is
median TTFT disagg / median TTFT colocated. Goal: every repeat <= 1.10.

Writes benchmarks/results/ttft_low_load.json and .png and the "TTFT at low load" section of
BENCHMARKS.md (not with --quick, another --output-len or --no-kv-shm: those write files of their
own and print their table). --no-kv-shm moves the prefill worker's K/V over gRPC, as to a decode
worker on another node. --draft gives every worker the demo draft: both arms speculate, and the
prefill worker also runs the draft over each prompt and sends its K/V.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from launcher import Launcher, samples
from report import GOAL_HEADER, Goal, Spread, host, machine, update_section
from tqdm import tqdm

from pdserve.loadgen.bench import BenchConfig, run_bench
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = str(REPO / "models" / "demo")
DRAFT = str(REPO / "models" / "demo-draft")
WORKER = ["--model", MODEL, "--num-kv-blocks", "512", "--max-num-seqs", "8"]
PROMPT_LEN, OUTPUT_LEN = "uniform:256,768", "fixed:8"


def workload(output_len: str = OUTPUT_LEN) -> WorkloadConfig:
    return WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse(PROMPT_LEN),
                          LengthDistribution.parse(output_len), tokenizer=MODEL)


def start(run: Launcher, prefill_args: list[str] = (), worker_args: list[str] = ()) -> dict:
    worker = [*WORKER, *worker_args]
    prefill = run.worker("prefill-worker", "disagg-P", [*worker, *prefill_args], [0])
    decode = run.worker("decode-worker", "disagg-D", worker, [1])
    colocated = run.worker("decode-worker", "colocated-D", worker, [0])
    routers = {"disagg": run.router("disagg-R", MODEL, [prefill], [decode]),
               "colocated": run.router("colocated-R", MODEL, [], [colocated])}
    run.wait_ready()
    return routers


STAGES = ("queue", "prefill", "transfer", "delivery")


def stage_means(metrics_address: str) -> dict[str, float]:
    """The router's TTFT by stage (`time_to_first_token_stage_seconds`), mean seconds per request
    over every request it served (warm-ups included)."""
    sums, counts = {}, {}
    for s in samples(metrics_address):
        if s.name.endswith("time_to_first_token_stage_seconds_sum"):
            sums[s.labels["stage"]] = s.value
        elif s.name.endswith("time_to_first_token_stage_seconds_count"):
            counts[s.labels["stage"]] = s.value
    return {stage: sums[stage] / counts[stage] if counts.get(stage) else 0.0 for stage in STAGES}


def ttft(address: str, num: int, seed: int, num_warmup: int, output_len: str = OUTPUT_LEN
         ) -> list[tuple[float, float | None]]:
    """(TTFT, TPOT) seconds of `num` requests sent one at a time."""
    cfg = BenchConfig(target=address, workload=workload(output_len), rates=(float("inf"),), num_requests=num,
                      max_concurrency=1, seed=seed, num_warmup=num_warmup)
    (run,) = run_bench(cfg, progress=False).runs
    failed = [r.error for r in run.records if not r.is_ok]
    assert not failed, f"requests failed: {failed[:3]}"
    return [(r.ttft_s, r.tpot_s) for r in run.records]


def one_repeat(addresses: dict[str, str], r: int, num_requests: int, block: int, output_len: str = OUTPUT_LEN) -> dict:
    """Blocks of `block` requests, the arms alternating block by block (the same prompts in both
    arms of a block, new ones each block)."""
    samples = {arm: [] for arm in addresses}
    for b in range(-(-num_requests // block)):
        order = ["disagg", "colocated"] if (r + b) % 2 == 0 else ["colocated", "disagg"]
        n = min(block, num_requests - b * block)
        for arm in order:
            samples[arm] += ttft(addresses[arm], n, seed=1000 * r + b, num_warmup=2 if b == 0 else 0,
                                 output_len=output_len)
    out = {}
    for arm, xs in samples.items():
        ttfts = sorted(t for t, _ in xs)
        tpots = [t for _, t in xs if t is not None] or [float("nan")]  # one-token answers have none
        out[arm] = {"ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
                    "tpot_p50_s": statistics.median(tpots), "ttft_s": [t for t, _ in xs]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 repeats of 4 requests: checks the script works")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-requests", type=int, default=20, help="per arm and repeat")
    p.add_argument("--block", type=int, default=5, help="requests per arm before the other arm's turn")
    p.add_argument("--out", default=None, help="path stem of the JSON and PNG (default: "
                   "benchmarks/results/ttft_low_load, with _quick after it for --quick)")
    p.add_argument("--output-len", default=OUTPUT_LEN, help="output lengths (fixed:1: answers that end at the "
                   "first token); only the default run rewrites BENCHMARKS.md")
    p.add_argument("--no-kv-shm", action="store_true", help="the prefill worker's K/V over gRPC, as to a decode "
                   "worker on another node (it does not rewrite BENCHMARKS.md)")
    p.add_argument("--draft", action="store_true", help="every worker with the demo draft (speculative "
                   "decoding in both arms; it does not rewrite BENCHMARKS.md)")
    args = p.parse_args()
    if args.out is None:  # a smoke run leaves the measured files alone
        args.out = str(RESULTS / ("ttft_low_load_quick" if args.quick else "ttft_low_load"))
    if args.quick:
        args.repeats, args.num_requests, args.block = 2, 4, 2
    runs = []
    with tempfile.TemporaryDirectory() as logs, Launcher(Path(logs)) as run:
        routers = start(run, ["--no-kv-shm"] if args.no_kv_shm else [], ["--draft-model", DRAFT] if args.draft else [])
        addresses = {arm: router.address for arm, router in routers.items()}
        for r in tqdm(range(args.repeats), desc="repeats", unit="repeat"):
            runs.append(one_repeat(addresses, r, args.num_requests, args.block, args.output_len))
        stages = {arm: stage_means(router.metrics_address) for arm, router in routers.items()}
    ratio = Spread.of(rep["disagg"]["ttft_p50_s"] / rep["colocated"]["ttft_p50_s"] for rep in runs)
    goal = Goal("disaggregated TTFT / colocated TTFT at low load (median per repeat)", ratio, 1.10, is_floor=False)
    result = {"repeats": runs, "stages_mean_s": stages, "goal": goal.as_dict(), "machine": machine(),
              "workload": {"prompt_len": PROMPT_LEN, "output_len": args.output_len}, "config": vars(args)}
    out = Path(args.out)
    if (args.output_len != OUTPUT_LEN or args.no_kv_shm or args.draft) and args.out == str(RESULTS / "ttft_low_load"):
        # the default run's files stay
        out = RESULTS / "_".join(["ttft_low_load", *(["no_kv_shm"] if args.no_kv_shm else []),
                                  *(["draft"] if args.draft else []),
                                  *([args.output_len.replace(':', '')] if args.output_len != OUTPUT_LEN else [])])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(runs, out.with_suffix(".png"))
    out_name = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)
    body = markdown(runs, stages, goal, args, host(result["machine"]), out_name)
    print(body)
    if not args.quick and args.output_len == OUTPUT_LEN and not args.no_kv_shm and not args.draft:
        update_section(REPO / "BENCHMARKS.md", "TTFT at low load (`benchmarks/ttft_low_load.py`)", body)


def markdown(runs: list[dict], stages: dict, goal: Goal, args, host_line: str,
             out_name: str = "benchmarks/results/ttft_low_load") -> str:
    ms = lambda arm, key: Spread.of(rep[arm][key] * 1e3 for rep in runs)  # noqa: E731
    lines = [f"Command: `PYTHONPATH=benchmarks .venv/bin/python benchmarks/ttft_low_load.py --repeats "
             f"{args.repeats} --num-requests {args.num_requests} --block {args.block}"
             + (f" --output-len {args.output_len}" if args.output_len != OUTPUT_LEN else "")
             + (" --no-kv-shm" if args.no_kv_shm else "") + (" --draft" if args.draft else "")
             + f"`, through `pdserve bench` (`--max-concurrency 1`), prompts {PROMPT_LEN} tokens of code, "
             f"{args.output_len} output tokens, "
             "demo target, one torch thread per worker, workers pinned (disagg: prefill core 0, decode core 1; "
             "colocated: one worker on core 0), "
             + ("the prefill worker's K/V over gRPC (`--no-kv-shm`), " if args.no_kv_shm else "")
             + ("every worker with the demo draft (`--draft`: both arms speculate, the prefill worker runs "
                "the draft over each prompt and sends its K/V), " if args.draft else "")
             + "default worker settings otherwise. Output: "
             f"`{out_name}.json`, `.png`. "
             f"Machine: {host_line}.", "",
             "| arm | TTFT p50 (ms), min / median / max over repeats | TTFT p90 (ms) | TPOT p50 (ms) |",
             "|---|---|---|---|"]
    for arm in ("disagg", "colocated"):
        lines.append(f"| {arm} | {ms(arm, 'ttft_p50_s').fmt(1)} | {ms(arm, 'ttft_p90_s').fmt(1)} | "
                     f"{ms(arm, 'tpot_p50_s').fmt(2)} |")
    lines += ["", *GOAL_HEADER, goal.row(), "",
              "Where the time goes: the routers' TTFT by stage (`pdserve:time_to_first_token_stage_seconds`, "
              "mean per request over the whole run, warm-ups included). *queue*: arrival until the decode "
              "worker reserved blocks (disaggregated: the reservation call); *prefill*: disaggregated, the "
              "prefill worker's own account from receiving the request to sampling the first token; "
              "colocated, the reservation until the first token reached the router; *transfer*: the rest "
              "until the router had the first token; *delivery*: detokenizing it and sending it on.", "",
              "| arm | " + " | ".join(f"{stage} (ms)" for stage in STAGES) + " | sum (ms) |",
              "|---" * (len(STAGES) + 2) + "|"]
    for arm in ("disagg", "colocated"):
        means = stages[arm]
        lines.append(f"| {arm} | " + " | ".join(f"{means[stage] * 1e3:.1f}" for stage in STAGES)
                     + f" | {sum(means.values()) * 1e3:.1f} |")
    diff = {stage: stages["disagg"][stage] - stages["colocated"][stage] for stage in STAGES}
    worst = max(diff, key=diff.get)
    lines += ["", f"Mean TTFT, disaggregated minus colocated: {sum(diff.values()) * 1e3:+.1f} ms, of which "
              f"{diff[worst] * 1e3:+.1f} ms in the {worst} stage. "
              "The first token leaves the prefill worker as soon as it is sampled (`PrefillStream`), so "
              "the K/V transfer and the decode worker's activation are off the TTFT path."]
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

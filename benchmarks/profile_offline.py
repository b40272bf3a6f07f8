"""Where pdserve's offline time goes, next to `transformers`, on the offline_throughput workloads.

Prints, for one model: the number of torch ops per batch-1 decode step on each side (a
load-independent measure of overhead), torch.profiler's top ops by self CPU time, and a
cProfile of pdserve's Python functions on the mixed batch.

    python benchmarks/profile_offline.py --model llama-100m [--threads 1]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import offline_throughput as ot


def torch_profile(runner, requests, row_limit: int) -> tuple[int, str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.generate(requests)
    events = prof.key_averages()
    num_ops = sum(e.count for e in events if e.key.startswith("aten::"))
    return num_ops, events.table(sort_by="self_cpu_time_total", row_limit=row_limit)


def python_profile(runner, requests, row_limit: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    runner.generate(requests)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(row_limit)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-100m", choices=list(ot.MODELS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rows", type=int, default=20)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ot.BenchConfig()
    spec = ot.MODELS[args.model]
    path = ot.build_checkpoint(spec, cfg.cache_dir)
    runners = [ot.PdserveRunner(path, {}), ot.HFRunner(path, cfg.hf_batch_size)]
    b1 = [ot.Request(list(range(3, 3 + cfg.b1_prompt_len)), args.new_tokens)]
    first = [ot.Request(b1[0].prompt_token_ids, 1)]
    for r in runners:
        r.generate(b1)
    for r in runners:
        n_full, table = torch_profile(r, b1, args.rows)
        n_first, _ = torch_profile(r, first, args.rows)
        print(f"== {r.name}: batch-1 decode, {(n_full - n_first) / (args.new_tokens - 1):.0f} aten ops per step")
        print(table)
    mixed = ot.make_workload(cfg, spec.vocab_size)
    for r in runners:
        n_ops, table = torch_profile(r, mixed, args.rows)
        print(f"== {r.name}: mixed batch of {len(mixed)}, {n_ops} aten ops in all")
        print(table)
    print("== pdserve: mixed batch, Python functions by own time")
    print(python_profile(runners[0], mixed, args.rows))


if __name__ == "__main__":
    main()

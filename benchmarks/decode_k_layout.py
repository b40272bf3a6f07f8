"""The key pass of a decode step's attention over K blocks in two layouts, side by side in one run:
row-major (the KV cache's layout today) against dims-major (each block's keys stored by dimension).

    python benchmarks/decode_k_layout.py [--repeats 7] [--quick] [--no-markdown]

Why: a decode step's attention reads every key of every sequence once, and at a 1024-token context
it is a large share of the step (a bfloat16 cache, half the bytes, made the demo's batch-32 step
1.39-1.55x faster: BENCHMARKS.md, KV cache dtype). On a float32 cache the key pass reads far below
the memory's bandwidth. This measures what the layout costs, before the cache's layout (a contract
of every attention path and of the K/V transfer) is changed for it.

It compiles `benchmarks/decode_k_layout.cpp` against the production vector code
(`kernels/cpu/attention_vectors.h`, -O3 -march=native as the native ops build) and times, per case,
three passes over the same keys' values into the same scores: `row-major` (`dot16` per query row,
a horizontal sum of sixteen vectors per sixteen keys: what `paged_attention_cpu`'s decode items
do), `transposed` (the row-major block's sixteen keys transposed, then vertical multiply-adds:
what its prefill items do with many rows) and `dims-major` (the vertical multiply-adds straight
from a dims-major block). Cases: the demo target's attention (8 layers, 4 KV heads of 32, 2
query heads each), two layers of a Llama-3.2-1B-like model (8 KV heads of 64, 4 query heads each),
a Llama-3-8B-like layer (8 KV heads of 128, 4 query heads each), batch 32 at a 1024-token context
and batch 1 at 16384, a sequence's blocks in order in memory and scattered.
Each case holds 64-128 MiB of keys, and a 64 MiB sweep evicts the caches before every timed pass.
The variants run in a rotating order within each of --repeats repeats; each figure is min /
median / max over them, the speedup a ratio within a repeat, and each variant's scores are
checked against row-major's. One thread. Needs AVX-512 (the production row-major path is
AVX-512's `dot16`). Writes JSON and a PNG under benchmarks/results/ and, unless --no-markdown or
--quick, its section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from report import Spread, files_line, fmt_spread, host, machine, measure_read_bandwidth, publish  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SOURCE = REPO / "benchmarks" / "decode_k_layout.cpp"
SECTION = "Decode key pass by K layout (`benchmarks/decode_k_layout.py`)"
VARIANTS = ("row-major", "transposed", "dims-major")
BLOCK = 16
# name, head_dim, KV heads, query heads per KV head, sequences, context, layers
CASES = (
    ("demo, batch 32, context 1024", 32, 4, 2, 32, 1024, 8),
    ("demo, batch 1, context 16384", 32, 4, 2, 1, 16384, 8),
    ("Llama-1B-like, batch 32, context 1024", 64, 8, 4, 32, 1024, 2),
    ("Llama-8B-like layer, batch 32, context 1024", 128, 8, 4, 32, 1024, 1),
)
QUICK_CASES = (("demo, batch 2, context 256", 32, 4, 2, 2, 256, 2), ("Llama-like, batch 2, context 64", 128, 2, 4, 2, 64, 1))
MAX_DIFF = 1e-3  # the variants' scores against row-major's (float32 sums in other orders)


def compile_program(out_dir: Path) -> Path:
    """The measuring program, built as the native ops are (`kernels/native.py`'s flags)."""
    binary = out_dir / "decode_k_layout"
    cmd = [os.environ.get("CXX", "c++"), "-O3", "-march=native", "-std=c++17", f"-I{REPO / 'kernels' / 'cpu'}",
           str(SOURCE), "-o", str(binary)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return binary


def measure(binary: Path, case: tuple, order: str, repeats: int) -> dict:
    name, head_dim, kv, group, seqs, context, layers = case
    args = [str(binary), *(str(x) for x in (head_dim, kv, group, seqs, context, layers)), order, str(repeats)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"decode_k_layout: {' '.join(args[1:])} failed: {proc.stderr.strip()}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    reps, diff = [x["seconds"] for x in lines if "repeat" in x], lines[-1]["max_abs_diff"]
    if max(diff.values()) > MAX_DIFF:
        raise SystemExit(f"decode_k_layout: {name} ({order}): scores differ from row-major's by {diff}")
    key_bytes = 4 * head_dim * kv * seqs * context * layers
    return dict(case=name, order=order, head_dim=head_dim, kv_heads=kv, group=group, seqs=seqs, context=context,
                layers=layers, key_mib=key_bytes / 2**20, max_abs_diff=diff,
                ms={v: Spread.of(r[v] * 1e3 for r in reps).as_dict() for v in VARIANTS},
                gbps={v: Spread.of(key_bytes / r[v] / 1e9 for r in reps).as_dict() for v in VARIANTS},
                speedup={v: Spread.of(r["row-major"] / r[v] for r in reps).as_dict() for v in VARIANTS[1:]})


def run(cases, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        binary = compile_program(Path(tmp))
        rows = [measure(binary, case, order, repeats) for case in cases for order in ("in-order", "scattered")]
    # what one thread can read at all, for the GB/s columns (best of 5 sums over 256 MB)
    return dict(repeats=repeats, rows=rows, read_gbps=measure_read_bandwidth(), machine=machine())


def markdown(result: dict, command: str) -> str:
    lines = [f"Command: `{command}`. One thread on {host(result['machine'])}; min / median / max over "
             f"{result['repeats']} repeats, the variants in a rotating order within each, the caches evicted "
             "before every pass. The key pass of a decode step's attention (every query row's scores against its "
             "sequence's keys, float32) over blocks of 16 keys: row-major `[key][KV head][dim]`, the KV cache's "
             "layout today, scored as `paged_attention_cpu`'s decode items do (`dot16`: horizontal sums); the "
             "same blocks transposed first (`transpose16`, as its prefill items do); and dims-major "
             "`[KV head][dim][key]`, scored by vertical multiply-adds straight from the block. In order: a "
             "sequence's blocks one after another in memory; scattered: anywhere. Speedup: row-major's time over "
             "the variant's, within each repeat. GB/s: key bytes read per second; for scale, a one-thread `sum` "
             f"over 256 MB read {result['read_gbps']:.1f} GB/s in the same run (best of 5).", "",
             "| case | blocks | keys, MiB | row-major, ms | transposed, ms | dims-major, ms | row-major, GB/s | "
             "dims-major, GB/s | speedup, transposed | speedup, dims-major |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ms, gb, sp = r["ms"], r["gbps"], r["speedup"]
        lines.append(f"| {r['case']} | {r['order']} | {r['key_mib']:g} | {fmt_spread(ms['row-major'])} | "
                     f"{fmt_spread(ms['transposed'])} | {fmt_spread(ms['dims-major'])} | {fmt_spread(gb['row-major'], 1)} | "
                     f"{fmt_spread(gb['dims-major'], 1)} | {fmt_spread(sp['transposed'], 2, '×')} | {fmt_spread(sp['dims-major'], 2, '×')} |")
    stem = result.get("stem", "decode_k_layout")
    lines += files_line(stem)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from report import grouped_bars

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 4))
    grouped_bars(ax, [f"{r['case']}\n{r['order']}".replace(", ", "\n", 1) for r in rows],
                 [(v, [r["speedup"][v] for r in rows]) for v in VARIANTS[1:]])
    ax.axhline(1.0, color="grey", lw=1)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("speedup over row-major (key pass)")
    ax.set_title("Decode key pass by K block layout, one thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="two small cases, 2 repeats (a smoke run)")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    result = run(QUICK_CASES if args.quick else CASES, 2 if args.quick else args.repeats)
    result["stem"] = "decode_k_layout_quick" if args.quick else "decode_k_layout"
    publish(result, "decode_k_layout", argv if argv is not None else sys.argv[1:], args.out, markdown, plot,
            None if args.no_markdown or args.quick else SECTION, stem=result["stem"])


if __name__ == "__main__":
    main()

"""What a change to the CPU attention op bought: its decode step on several git revisions, side by
side in one run.

    python benchmarks/attention_by_change.py --variant before=REV --variant after=HEAD [--repeats 6]
        [--queries 1] [--quick] [--no-markdown]

Each variant is a revision's sources (unpacked with `git archive`, `report.export_revision`),
imported in a process of its own, which builds or loads that revision's native ops and times
`paged_attention_cpu` (the new tokens' K/V written, then every query head's attention over its
sequence's keys) for one decode step of 32 sequences at a 1024-token context (with --queries N, a
step of N new tokens a sequence, as a speculative verification of N - 1 drafts), float32, one thread:
the demo target's heads (8 query heads on 4 KV heads of 32), and Llama-3.2-1B- and Llama-3-8B-like
ones (32 on 8 of 64 and of 128). A sequence's blocks lie in order. A case's figure in a process is
the median of 12 calls after 3 warm-up calls. The variants take turns, one fresh process each per
repeat, the order reversed every repeat (the second of two back-to-back processes ran faster in a
scratch run with a fixed order). Per case: milliseconds per variant (min / median / max over
repeats) and the first variant's time over each other's within a repeat. JSON and a PNG under
benchmarks/results/ and, unless --no-markdown or --quick, its section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from report import (Spread, export_revision, files_line, fmt_spread, grouped_bars, host, machine,  # noqa: E402
                    publish, revision_subject)

RESULTS = REPO / "benchmarks" / "results"
SECTION = "Decode attention by change (`benchmarks/attention_by_change.py`)"
VERIFY_SECTION = "Verification attention by change (`benchmarks/attention_by_change.py --queries`)"
BLOCK = 16
# name, query heads, KV heads, head_dim, sequences, context
CASES = (("demo", 8, 4, 32, 32, 1024), ("Llama-1B-like", 32, 8, 64, 32, 1024), ("Llama-8B-like", 32, 8, 128, 32, 1024))
QUICK_CASES = (("demo", 8, 4, 32, 2, 64), ("Llama-8B-like", 32, 8, 128, 2, 64))
WARMUP, CALLS = 3, 12


def worker(cases: list, queries: int = 1) -> None:
    """In a variant's process: each case's median seconds, one JSON object on stdout."""
    import torch

    from pdserve.kernels import native

    torch.set_num_threads(1)
    if not native.load():
        raise SystemExit("attention_by_change: the native ops did not build in this revision's process")
    op = torch.ops.pdserve.paged_attention_cpu
    out = {}
    for name, heads, kv, head_dim, seqs, context in cases:
        g = torch.Generator().manual_seed(0)
        blocks = context // BLOCK
        k_cache = torch.randn(seqs * blocks + 1, BLOCK, kv, head_dim, generator=g)
        v_cache = torch.randn(seqs * blocks + 1, BLOCK, kv, head_dim, generator=g)
        ids = torch.arange(seqs * blocks).view(seqs, blocks)
        rows = seqs * queries  # each sequence's last `queries` tokens are the step's
        q = torch.randn(rows, heads, head_dim, generator=g)
        k, v = torch.randn(rows, kv, head_dim, generator=g), torch.randn(rows, kv, head_dim, generator=g)
        lens, starts = torch.full((seqs,), context), torch.arange(seqs + 1) * queries
        positions = torch.arange(context - queries, context)
        slots = (ids.gather(1, (positions // BLOCK).expand(seqs, -1)) * BLOCK + positions % BLOCK).reshape(-1)
        seconds = []
        for _ in range(WARMUP + CALLS):
            t = time.perf_counter()
            op(q, k, v, k_cache, v_cache, slots, ids, lens, starts, head_dim ** -0.5)
            seconds.append(time.perf_counter() - t)
        out[name] = statistics.median(seconds[WARMUP:])
    print(json.dumps(out))


def run(variants: list[tuple[str, str]], cases, repeats: int, queries: int = 1) -> dict:
    times: dict[str, list[dict]] = {name: [] for name, _ in variants}
    subjects = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, rev in variants:
            paths[name] = export_revision(rev, Path(tmp) / name)
            subjects[name] = revision_subject(rev)
        for rep in range(repeats):
            for name, _ in (variants if rep % 2 == 0 else variants[::-1]):
                env = dict(os.environ, PYTHONPATH=str(paths[name]), OMP_NUM_THREADS="1")
                proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cases),
                                       str(queries)],
                                      env=env, cwd=tmp, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    raise SystemExit(f"attention_by_change: variant {name} failed: {proc.stderr.strip()[-2000:]}")
                times[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first = variants[0][0]
    rows = []
    for case in cases:
        c = case[0]
        rows.append(dict(case=c, heads=case[1], kv_heads=case[2], head_dim=case[3], seqs=case[4], context=case[5],
                         ms={n: Spread.of(t[c] * 1e3 for t in times[n]).as_dict() for n, _ in variants},
                         speedup={n: Spread.of(a[c] / b[c] for a, b in zip(times[first], times[n])).as_dict()
                                  for n, _ in variants[1:]}))
    return dict(variants=[dict(name=n, revision=r, subject=subjects[n]) for n, r in variants], repeats=repeats,
                queries=queries, rows=rows, machine=machine())


def markdown(result: dict, command: str) -> str:
    names = [v["name"] for v in result["variants"]]
    first = names[0]
    queries = result.get("queries", 1)
    step = ("one decode step (the new token's K/V written" if queries == 1 else
            f"one step of {queries} new tokens a sequence, as a verification of {queries - 1} drafts (their K/V written")
    lines = [f"Command: `{command}`. `paged_attention_cpu`, {step}, then "
             f"attention over the context), float32, one thread, on {host(result['machine'])}; each variant a "
             f"revision in a fresh process per repeat, the order reversed every repeat; min / median / max over "
             f"{result['repeats']} repeats of each case's median call. Speedup: {first}'s time over the variant's, "
             "within a repeat.", "",
             "Variants: " + "; ".join(f"{v['name']} = `{v['subject']}`" for v in result["variants"]) + ".", "",
             "| case | heads (query / KV) × head_dim | batch × context | "
             + " | ".join(f"{n}, ms" for n in names) + " | " + " | ".join(f"speedup, {n}" for n in names[1:]) + " |",
             "|---|---|---|" + "---|" * (2 * len(names) - 1)]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['heads']} / {r['kv_heads']} × {r['head_dim']} | "
                     f"{r['seqs']} × {r['context']} | "
                     + " | ".join(fmt_spread(r["ms"][n]) for n in names) + " | "
                     + " | ".join(fmt_spread(r["speedup"][n], 2, "×") for n in names[1:]) + " |")
    stem = result.get("stem", "attention_by_change")
    lines += files_line(stem)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, names = result["rows"], [v["name"] for v in result["variants"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    grouped_bars(ax, [f"{r['case']}\nd{r['head_dim']}" for r in rows], [(n, [r["ms"][n] for r in rows]) for n in names])
    queries = result.get("queries", 1)
    ax.set_ylabel("ms per decode step's attention" if queries == 1 else f"ms per {queries}-token step's attention")
    ax.set_title("paged_attention_cpu by revision, one thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(json.loads(argv[1]), int(argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], help="NAME=REV (repeatable; the first is the base)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--queries", type=int, default=1,
                        help="new tokens a sequence in the timed step: 1, a decode step; k + 1, a verification of k drafts")
    parser.add_argument("--quick", action="store_true", help="small cases, 2 repeats (a smoke run)")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    variants = []
    for text in args.variant:
        name, sep, rev = text.partition("=")
        if not sep or not name or not rev:
            parser.error(f"--variant takes NAME=REV, got {text!r}")
        variants.append((name, rev))
    if len(variants) < 2 or len({n for n, _ in variants}) != len(variants):
        parser.error("give at least two --variant NAME=REV, with different names")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not 1 <= args.queries <= 16:
        parser.error("--queries must be 1 to 16 (a decode step, or a verification of up to 15 drafts)")
    result = run(variants, QUICK_CASES if args.quick else CASES, 2 if args.quick else args.repeats, args.queries)
    suffix = "" if args.queries == 1 else f"_q{args.queries}"
    result["stem"] = ("attention_by_change_quick" if args.quick else "attention_by_change") + suffix
    publish(result, "attention_by_change", argv, args.out, markdown, plot,
            None if args.no_markdown or args.quick else SECTION if args.queries == 1 else VERIFY_SECTION,
            stem=result["stem"])


if __name__ == "__main__":
    main()

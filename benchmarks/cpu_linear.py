"""The native float32 projections (`kernels/cpu/linear.cpp`) against torch's `F.linear` (the
BLAS), on one model's projection shapes, for the row counts a CPU step multiplies.

    python benchmarks/cpu_linear.py [--model models/demo] [--repeats 5] [--no-markdown]

Every projection of one layer of the model (fused q/k/v, o, fused gate/up, down) and its
lm_head, in float32, each in 8 copies so that a pass reads its weights from memory rather than
from the last-level cache, as a decode step does. One "pass" multiplies x [M, K] by every copy;
M is 1 (a batch-1 decode step), 2, 5 (a batch-1 verification at k = 4), 8, 16 (a batch-8
verification at k = 1), 32 (a batch-32 step),
64 and 160 (batch 32's verifications at k = 1 and 4). Variants, timed in turn within each repeat,
one torch thread:

- `torch`: `F.linear` on the [N, K] weights (what `cpu_linear="torch"` runs);
- `packed` : `linear_packed` of the library the engine loads (`-march=native`: AVX-512 here
  where the CPU has it);
- `packed-avx2`: the same source built again with `-mno-avx512f`, so its AVX2 loops run (what a
  CPU without AVX-512 gets); skipped where the CPU has no AVX2 with FMA;
- `packed-bf16`: the weights rounded to bfloat16 and packed in bfloat16 panels, what the engine
  runs for a bfloat16 checkpoint (the demo's): half the bytes, and on a CPU with AMX the tile path
  (`cpu/linear_amx.h`) from 7 rows, over the copy of the panels in the tile unit's order that
  `linear_pack` keeps; `packed-bf16-vector`: the same with the tile
  path switched off (`linear_use_tiles(False)`), skipped where there is none.

Per variant and M: milliseconds a pass (median of --iters passes per repeat), the weights' GB/s,
and the speedup over `torch` in the same repeat, as min / median / max over --repeats. Writes
JSON and a PNG under benchmarks/results/ and, unless --no-markdown, its section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from pdserve.engine.model.config import load_model_config  # noqa: E402
from pdserve.kernels import native  # noqa: E402
from report import Spread, files_line, fmt_spread, host, machine, publish  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SECTION = "CPU projections by instruction set (`benchmarks/cpu_linear.py`)"
ROWS = (1, 2, 5, 8, 16, 32, 64, 160)
COPIES = 8


def shapes_of(model: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one layer's projections, fused as the engine fuses
    them, and the lm_head."""
    cfg = load_model_config(model)
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    return [("qkv", cfg.num_heads * cfg.head_dim + 2 * kv, h), ("o", h, cfg.num_heads * cfg.head_dim),
            ("gate_up", 2 * cfg.intermediate_size, h), ("down", h, cfg.intermediate_size),
            ("lm_head", cfg.vocab_size, h)]


def avx2_ops(build_dir: str):
    """linear.cpp built without AVX-512 under a namespace of its own (None: this CPU has no AVX2 with FMA)."""
    from torch.utils import cpp_extension

    flags = open("/proc/cpuinfo").read()
    if " avx2" not in flags or " fma" not in flags:
        return None
    name = "pdserve_bench_linear_avx2"
    source = next(s for s in native.SOURCES if s.name == "linear.cpp")
    cpp_extension.load(name, [str(source)], extra_cflags=[*native.FLAGS, "-mno-avx512f", f"-DPDSERVE_OP_NAMESPACE={name}"],
                       extra_ldflags=list(native.LDFLAGS), is_python_module=False, verbose=False,
                       build_directory=build_dir)
    ops = getattr(torch.ops, name)
    return ops if ops.linear_packed_available() else None


@contextlib.contextmanager
def tiles(on: bool):
    """The library's tile path on or off (`linear_use_tiles`) for the block, as it was after."""
    before = torch.ops.pdserve.linear_use_tiles(on)
    try:
        yield
    finally:
        torch.ops.pdserve.linear_use_tiles(before)


def run(model: str, repeats: int, iters: int, progress: bool = True) -> dict:
    if not native.load():
        raise SystemExit(f"the native library does not build here: {native.error()}")
    torch.set_num_threads(1)
    shapes = shapes_of(model)
    gen = torch.Generator().manual_seed(0)
    weights = {name: [torch.randn(n, k, generator=gen) for _ in range(COPIES)] for name, n, k in shapes}
    variants = {"torch": None}
    ops = torch.ops.pdserve
    if ops.linear_packed_available():
        variants["packed"] = ops
    with tempfile.TemporaryDirectory() as build_dir:
        avx2 = avx2_ops(build_dir)
    if avx2 is not None:
        variants["packed-avx2"] = avx2
    if ops.linear_packed_available():
        variants["packed-bf16"] = ops
        if any(ops.linear_tile_rows(m) for m in ROWS):
            variants["packed-bf16-vector"] = ops
    half = {name: [w.bfloat16() for w in ws] for name, ws in weights.items()}
    weights_of = lambda v: half if "bf16" in v else weights  # noqa: E731 - a variant's weights
    packed = {v: {name: [o.linear_pack(w) for w in weights_of(v)[name]] for name, _, _ in shapes}
              for v, o in variants.items() if o is not None}
    weight_bytes = {v: sum(n * k * weights_of(v)[name][0].element_size() for name, n, k in shapes) * COPIES
                    for v in variants}
    for v in packed:  # what is timed computes F.linear's result
        for (name, n, k), m in zip(shapes * 2, ROWS + ROWS):
            x = torch.randn(m, k, generator=gen)
            with tiles(v != "packed-bf16-vector"):
                got = variants[v].linear_packed(x, packed[v][name][0], None, n)
            torch.testing.assert_close(got, F.linear(x, weights_of(v)[name][0].float()),
                                       rtol=1e-4, atol=1e-3,
                                       msg=lambda e, v=v, name=name: f"{v} differs from F.linear on {name}: {e}")

    def one_pass(variant: str, xs: dict) -> float:
        with tiles(variant != "packed-bf16-vector"):
            return timed_pass(variant, xs)

    def timed_pass(variant: str, xs: dict) -> float:
        ops = variants[variant]
        start = time.perf_counter()
        for name, n, _ in shapes:
            for i, w in enumerate(weights[name]):
                if ops is None:
                    F.linear(xs[name], w)
                else:
                    ops.linear_packed(xs[name], packed[variant][name][i], None, n)
        return time.perf_counter() - start

    seconds: dict[tuple[str, int], list[float]] = {}
    with tqdm(total=repeats * len(ROWS) * len(variants), desc="cpu_linear", unit="case", disable=not progress) as bar:
        for rep in range(repeats):
            for m in ROWS:
                xs = {name: torch.randn(m, k, generator=gen) for name, _, k in shapes}
                order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
                for v in order:
                    one_pass(v, xs)  # warm the code, not the weights (they do not fit the cache)
                    seconds.setdefault((v, m), []).append(statistics.median(one_pass(v, xs) for _ in range(iters)))
                    bar.update(1)
    rows = []
    for m in ROWS:
        for v in variants:
            per_rep = seconds[(v, m)]
            speedups = [t / s for t, s in zip(seconds[("torch", m)], per_rep)]
            rows.append(dict(variant=v, rows=m, ms=Spread.of(s * 1e3 for s in per_rep).as_dict(),
                             gbps=Spread.of(weight_bytes[v] / s / 1e9 for s in per_rep).as_dict(),
                             speedup=Spread.of(speedups).as_dict()))
    return dict(model=model, shapes=shapes, copies=COPIES, weight_bytes=weight_bytes["torch"], repeats=repeats, iters=iters,
                variants=list(variants), rows=rows, machine=machine())


def markdown(result: dict, command: str) -> str:
    shapes = ", ".join(f"{name} {n}×{k}" for name, n, k in result["shapes"])
    model = Path(result["model"]).resolve()
    model = model.relative_to(REPO) if model.is_relative_to(REPO) else model
    lines = [f"Command: `{command}`. Projections of one layer of `{model}` and its lm_head ({shapes}), "
             f"{result['copies']} copies each ({result['weight_bytes'] / 1e6:.0f} MB, read from memory), one torch "
             f"thread, on {host(result['machine'])}; min / median / max over {result['repeats']} interleaved "
             "repeats, speedups against `torch` (`F.linear`) in the same repeat. `packed` is the library the engine "
             "loads (built for this CPU); `packed-avx2` the same source built without AVX-512, which is what a CPU "
             "with AVX2 and no AVX-512 runs; `packed-bf16` the weights rounded to bfloat16 in bfloat16 panels, what "
             "the engine runs for a bfloat16 checkpoint such as the demo's (half the bytes; the tile path of "
             "`kernels/cpu/linear_amx.h` from 7 rows where the CPU has AMX), `packed-bf16-vector` "
             "the same with the tile path off. GB/s counts each variant's own weight bytes.", "",
             "| rows (M) | variant | ms a pass | weights GB/s | speedup over torch |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        speed = "–" if r["variant"] == "torch" else fmt_spread(r["speedup"], 2, "×")
        lines.append(f"| {r['rows']} | {r['variant']} | {fmt_spread(r['ms'], 3)} | {fmt_spread(r['gbps'], 1)} | {speed} |")
    lines += files_line("cpu_linear")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for v in result["variants"]:
        rows = [r for r in result["rows"] if r["variant"] == v]
        ax.errorbar([r["rows"] for r in rows], [r["ms"]["median"] for r in rows],
                    yerr=[[r["ms"]["median"] - r["ms"]["min"] for r in rows], [r["ms"]["max"] - r["ms"]["median"] for r in rows]],
                    marker="o", capsize=3, label=v)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows multiplied (M)")
    ax.set_ylabel("ms a pass over the weights")
    ax.set_title(f"{Path(result['model']).name} projections, {result['weight_bytes'] / 1e6:.0f} MB, 1 thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "demo"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="passes per variant, M and repeat (their median counts)")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.iters < 1:
        parser.error("--repeats and --iters must be at least 1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args.model, args.repeats, args.iters)
    publish(result, "cpu_linear", argv if argv is not None else sys.argv[1:], args.out, markdown, plot,
            None if args.no_markdown else SECTION)

if __name__ == "__main__":
    main()

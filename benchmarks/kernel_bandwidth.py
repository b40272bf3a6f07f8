"""Kernel micro-benchmarks: achieved memory bandwidth and speed against the torch references.

    python benchmarks/kernel_bandwidth.py [--peak-tbps 4.8] [--peak-name H200] [--out benchmarks/results]

For each op it times the Triton launcher and its `*_ref` side by side in one run (and, for the
attention ops, `scaled_dot_product_attention` on the equivalent dense, unpaged tensors), and
reports bytes moved / time as a share of the device's peak bandwidth (given, default H200's
4.8 TB/s). Writes JSON and a PNG plot under --out. Needs CUDA; elsewhere it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F



@dataclass(slots=True)
class Case:
    name: str
    bytes_moved: int
    triton_fn: Callable[[], object]
    ref_fn: Callable[[], object]
    dense_fn: Callable[[], object] | None = None  # SDPA on equivalent dense tensors


@dataclass(slots=True)
class Row:
    name: str
    bytes_moved: int
    triton_ms: float
    ref_ms: float
    dense_sdpa_ms: float | None
    bandwidth_gbps: float
    peak_share: float
    speedup_vs_ref: float
    speedup_vs_sdpa: float | None


def paged_kv(num_seqs, context, num_kv_heads, head_dim, block_size, dtype, dev, seed: int | None = None):
    """Random K/V caches, every sequence `context` tokens long with its blocks scattered (a random
    permutation); from torch's global generator, or a generator of its own when seeded. Also
    `gpu_check.py`'s."""
    g = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    blocks = -(-context // block_size)
    k_cache = torch.randn(num_seqs * blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev, generator=g)
    v_cache = torch.randn(k_cache.shape, dtype=dtype, device=dev, generator=g)
    tables = torch.randperm(num_seqs * blocks, device=dev, generator=g).view(num_seqs, blocks).to(torch.int32)
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device=dev)
    return k_cache, v_cache, tables, lens


def build_cases(dev: str, dtype: torch.dtype) -> list[Case]:
    from pdserve.kernels import extend_attention as ea
    from pdserve.kernels import kv_write, paged_attention as pa, rmsnorm, rotary, sampling

    el = torch.finfo(dtype).bits // 8
    cases = []
    tokens, hidden = 8192, 4096
    x, r = (torch.randn(tokens, hidden, dtype=dtype, device=dev) for _ in range(2))
    w = torch.ones(hidden, dtype=dtype, device=dev)
    cases.append(Case("rms_norm", 2 * x.numel() * el, lambda: rmsnorm.rms_norm(x, w, 1e-6),
                      lambda: rmsnorm.rms_norm_ref(x, w, 1e-6)))
    cases.append(Case("fused_add_rms_norm", 4 * x.numel() * el, lambda: rmsnorm.fused_add_rms_norm(x, r, w, 1e-6),
                      lambda: rmsnorm.fused_add_rms_norm_ref(x, r, w, 1e-6)))
    qk = torch.randn(tokens, 32 + 8, 128, dtype=dtype, device=dev)  # q's and k's heads, rotated in one call
    k = qk[:, 32:].contiguous()
    cos, sin = rotary.rope_at(*(t.to(dev) for t in rotary.build_rope_cache(128, 8192, 500000.0)),
                              torch.arange(tokens, device=dev), dtype)
    cases.append(Case("apply_rotary (q and k heads)", 2 * qk.numel() * el + 2 * cos.numel() * el,
                      lambda: rotary.apply_rotary(qk, cos, sin), lambda: rotary.apply_rotary_ref(qk, cos, sin)))
    k_cache, v_cache, _, _ = paged_kv(1, tokens, 8, 128, 16, dtype, dev)
    slots = torch.randperm(k_cache.shape[0] * 16, device=dev)[:tokens]
    cases.append(Case("write_kv", 4 * k.numel() * el, lambda: kv_write.write_kv(k, k, k_cache, v_cache, slots),
                      lambda: kv_write.write_kv_ref(k, k, k_cache, v_cache, slots)))
    for num_seqs, context in ((64, 2048), (4, 32768)):  # many short: one pass; few long: split-K
        kc, vc, tables, lens = paged_kv(num_seqs, context, 8, 128, 16, dtype, dev)
        qd = torch.randn(num_seqs, 32, 128, dtype=dtype, device=dev)
        kd, vd = (torch.randn(num_seqs, 8, context, 128, dtype=dtype, device=dev) for _ in range(2))
        cases.append(Case(
            f"paged_decode_attention b{num_seqs} ctx{context}", 2 * kc.numel() * el + 2 * qd.numel() * el,
            lambda qd=qd, kc=kc, vc=vc, t=tables, n=lens: pa.paged_decode_attention(qd, kc, vc, t, n, 0.088),
            lambda qd=qd, kc=kc, vc=vc, t=tables, n=lens: pa.paged_decode_attention_ref(qd, kc, vc, t, n, 0.088),
            lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd[:, :, None], kd, vd, scale=0.088, enable_gqa=True)))
    num_seqs, chunk, context = 4, 512, 2048  # chunked prefill: a 512-token chunk after 1536 cached
    kc, vc, tables, lens = paged_kv(num_seqs, context, 8, 128, 16, dtype, dev)
    qe = torch.randn(num_seqs * chunk, 32, 128, dtype=dtype, device=dev)
    cu = torch.arange(0, num_seqs * chunk + 1, chunk, dtype=torch.int32, device=dev)
    qdense = qe.view(num_seqs, chunk, 32, 128).transpose(1, 2)
    kd, vd = (torch.randn(num_seqs, 8, context, 128, dtype=dtype, device=dev) for _ in range(2))
    mask = torch.ones(chunk, context, dtype=torch.bool, device=dev).tril(context - chunk)
    cases.append(Case(
        "extend_attention 4x512 on 2048", 2 * kc.numel() * el + 2 * qe.numel() * el,
        lambda: ea.extend_attention(qe, kc, vc, tables, cu, lens, 0.088),
        lambda: ea.extend_attention_ref(qe, kc, vc, tables, cu, lens, 0.088),
        lambda: F.scaled_dot_product_attention(qdense, kd, vd, attn_mask=mask, scale=0.088, enable_gqa=True)))
    rows, vocab = 128, 128256
    logits = torch.randn(rows, vocab, device=dev)
    noise = -torch.rand(rows, vocab, device=dev).log()
    params = (torch.full((rows,), 0.8, device=dev), torch.full((rows,), 50, device=dev, dtype=torch.int64),
              torch.full((rows,), 0.9, device=dev), torch.full((rows,), 0.05, device=dev), noise)
    # bytes: the logits and the noise once (the kernel re-reads the logits per search pass, mostly from L2)
    cases.append(Case("sample (top-k 50, top-p .9, min-p .05)", 2 * logits.numel() * 4,
                      lambda: sampling.sample(logits, *params), lambda: sampling.sample_ref(logits, *params)))
    return cases


def measure(cases: list[Case], peak_tbps: float) -> list[Row]:
    from tqdm import tqdm
    from triton.testing import do_bench

    rows = []
    for case in tqdm(cases, desc="kernels", unit="op"):
        t_ms, r_ms = do_bench(case.triton_fn), do_bench(case.ref_fn)
        d_ms = do_bench(case.dense_fn) if case.dense_fn else None
        gbps = case.bytes_moved / (t_ms * 1e-3) / 1e9
        rows.append(Row(case.name, case.bytes_moved, t_ms, r_ms, d_ms, gbps, gbps / (peak_tbps * 1e3),
                        r_ms / t_ms, d_ms / t_ms if d_ms else None))
    return rows


def write_results(rows: list[Row], out_dir: Path, peak_name: str, peak_tbps: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"device": torch.cuda.get_device_name(), "peak": peak_name, "peak_tbps": peak_tbps,
            "command": " ".join(sys.argv)}
    (out_dir / f"kernels-{stamp}.json").write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    names = [r.name for r in rows]
    ax1.barh(names, [100 * r.peak_share for r in rows])
    ax1.set_xlabel(f"% of peak bandwidth ({peak_name}, {peak_tbps} TB/s)")
    ax2.barh(names, [r.speedup_vs_ref for r in rows])
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("speed-up over the torch reference (x)")
    ax2.set_yticks([])
    fig.suptitle(meta["device"])
    fig.tight_layout()
    fig.savefig(out_dir / f"kernels-{stamp}.png", dpi=120)
    print(f"wrote {out_dir}/kernels-{stamp}.json and .png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="peak memory bandwidth, TB/s (default: H200)")
    parser.add_argument("--peak-name", default="H200", help="what the peak figure belongs to, for the report")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_bandwidth.py needs CUDA (it times compiled Triton kernels on a GPU); "
              "no CUDA device here, so nothing was measured.")
        return 0
    print(f"peak bandwidth: {args.peak_tbps} TB/s ({args.peak_name}); device: {torch.cuda.get_device_name()}")
    rows = measure(build_cases("cuda", getattr(torch, args.dtype)), args.peak_tbps)
    for r in rows:
        dense = f"  vs SDPA dense x{r.speedup_vs_sdpa:.2f}" if r.speedup_vs_sdpa else ""
        print(f"{r.name:42s} {r.triton_ms:8.3f} ms  {r.bandwidth_gbps:8.1f} GB/s  "
              f"{100 * r.peak_share:5.1f}% of peak  vs ref x{r.speedup_vs_ref:.2f}{dense}")
    write_results(rows, args.out, args.peak_name, args.peak_tbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

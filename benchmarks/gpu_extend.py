"""`gpu_check.py`'s extend part: the prefill attention kernel (`kernels/extend_attention.py`)
against dense attention at Llama-3.2-1B's heads (32 query, 8 KV, head_dim 64, bf16, 16-token
blocks), and a sweep of its launch settings, each checked against the reference before it is
timed (`cuda_timing.graph_ms`). Shapes: a chunked prefill (4 chunks of 512 tokens after 1536
cached), a fresh 2048-token prompt, and speculative verification (32 sequences, 5 queries each,
on 2048 tokens). FLOP/s count the causal products actually needed (each query over the keys
at or before it: 4 multiply-adds per key and head_dim element)."""
from __future__ import annotations

import itertools

from cuda_timing import graph_ms, host_ms

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16
SHAPES = {  # name -> (sequences, new tokens each, context each)
    "chunk 4x512 on 2048": (4, 512, 2048),
    "prompt 1x2048": (1, 2048, 2048),
    "verify 32x5 on 2048": (32, 5, 2048),
}
SMOKE_SHAPES = {"chunk 2x24 on 40": (2, 24, 40), "verify 2x5 on 40": (2, 5, 40)}


def _inputs(num_seqs: int, chunk: int, context: int, heads: int, kv_heads: int, dtype, device):
    import torch

    from kernel_bandwidth import paged_kv

    kc, vc, tables, lens = paged_kv(num_seqs, context, kv_heads, HEAD_DIM, BLOCK, dtype, device)
    q = torch.randn(num_seqs * chunk, heads, HEAD_DIM, dtype=dtype, device=device)
    cu = torch.arange(0, num_seqs * chunk + 1, chunk, dtype=torch.int32, device=device)
    return q, kc, vc, tables, cu, lens


def _dense(q, num_seqs: int, chunk: int, context: int, kv_heads: int):
    """torch's SDPA on the same problem, K and V dense: its flash kernel where the mask allows
    (a fresh prompt: is_causal), else an explicit mask."""
    import torch
    import torch.nn.functional as F

    qd = q.view(num_seqs, chunk, -1, HEAD_DIM).transpose(1, 2)
    kd, vd = (torch.randn(num_seqs, kv_heads, context, HEAD_DIM, dtype=q.dtype, device=q.device) for _ in range(2))
    if chunk == context:
        return lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=0.125, enable_gqa=True)
    mask = torch.ones(chunk, context, dtype=torch.bool, device=q.device).tril(context - chunk)
    return lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=0.125, enable_gqa=True)


def _settings(chunk: int, smoke: bool) -> list[dict]:
    """fp32 products at the default tiles, then 16-bit products over tiles and warps: 16-row
    tiles for verification's short chunks, 64 and 128 rows for prefill's."""
    rows = (16,) if chunk <= 16 else (64, 128)
    grid = [dict(cache_dtype_dots=True, block_m=m, block_n=n, num_warps=w)
            for m, n, w in itertools.product(rows, (32, 64, 128), (4, 8))]
    return [dict(cache_dtype_dots=False)] + (grid[:2] if smoke else grid)


def part_extend(sizes, report: dict) -> dict:
    import torch

    from pdserve.kernels import extend_attention as ea

    dtype = torch.float16 if sizes.smoke else torch.bfloat16  # the interpreter has no bf16 products
    timer = (lambda fn: host_ms(fn, runs=1)) if sizes.smoke else (lambda fn: graph_ms(fn, reps=10))
    tol = dict(atol=4e-2, rtol=3.2e-2)  # the bf16 kernel test's, twice: 16-bit products round once more
    shapes = SMOKE_SHAPES if sizes.smoke else SHAPES
    heads, kv_heads = (4, 2) if sizes.smoke else (HEADS, KV_HEADS)
    out: dict = dict(heads=heads, kv_heads=kv_heads, head_dim=HEAD_DIM, shapes={})
    for name, (num_seqs, chunk, context) in shapes.items():
        q, kc, vc, tables, cu, lens = _inputs(num_seqs, chunk, context, heads, kv_heads, dtype, sizes.device)
        want = ea.extend_attention_ref(q.float(), kc.float(), vc.float(), tables, cu, lens, 0.125)
        keys = num_seqs * sum(context - chunk + i + 1 for i in range(chunk))  # (query, key) pairs in view
        flops = 4 * keys * heads * HEAD_DIM
        row: dict = dict(num_seqs=num_seqs, chunk=chunk, context=context, flops=flops, sweep=[])
        try:
            row["dense_ms"] = timer(_dense(q, num_seqs, chunk, context, kv_heads))
        except Exception as exc:  # noqa: BLE001 - a missing SDPA path leaves the rest
            row["dense_error"] = f"{type(exc).__name__}: {exc}"
        candidates = [("default", {})] + [(str(s), s) for s in _settings(chunk, sizes.smoke)]
        for label, settings in candidates:
            fn = lambda s=settings: ea.extend_attention_with_settings(q, kc, vc, tables, cu, lens, 0.125, **s)  # noqa: E731
            try:
                err = (fn().float() - want).abs().max().item()
                ok = bool(torch.allclose(fn().float(), want, **tol))
                ms = timer(fn) if ok else None
            except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses (registers, shared memory)
                row["sweep"].append(dict(settings=settings, label=label, error=f"{type(exc).__name__}: {exc}"[:300]))
                print(f"    {name:22s} {label:70s} ERROR {type(exc).__name__}")
                continue
            entry = dict(settings=settings, label=label, max_abs_err=err, ok=ok, ms=ms,
                         tflops=flops / (ms * 1e-3) / 1e12 if ms else None)
            row["sweep"].append(entry)
            dense = f"  {row['dense_ms'] / ms:.2f}x dense SDPA" if ms and "dense_ms" in row else ""
            print(f"    {name:22s} {label:70s} " + (f"{ms * 1e3:8.1f} us {entry['tflops']:6.1f} TFLOP/s{dense}"
                                                   if ms else f"MISMATCH max |err| {err:.3g}"))
        timed = [e for e in row["sweep"] if e.get("ms")]
        row["default"] = next((e for e in timed if e["label"] == "default"), None)
        row["best"] = min(timed, key=lambda e: e["ms"]) if timed else None
        out["shapes"][name] = row
        d, b = row["default"], row["best"]
        if d and b:
            print(f"  {name}: default {d['ms'] * 1e3:.1f} us, best {b['ms'] * 1e3:.1f} us {b['label']}"
                  + (f"; dense SDPA {row['dense_ms'] * 1e3:.1f} us" if "dense_ms" in row else ""))
    out["ok"] = all(e.get("ok", False) for r in out["shapes"].values() for e in r["sweep"] if "error" not in e)
    return out

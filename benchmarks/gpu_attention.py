"""`gpu_check.py`'s attention part: paged decode attention's bandwidth at batch 32, context 2048
(Llama-3.2-1B's heads: 32 query, 8 KV, head_dim 64, bf16, 16-token blocks), and a sweep of the
launcher's settings and kernel variants, each checked against the reference before it is timed.

Every time is `cuda_timing.graph_ms` (CUDA-graph replays after a read-only L2 flush: what the
engine's captured decode step runs). The default launcher is also timed two other ways, side
by side: without the flush, and eagerly with Triton's `do_bench` (the figure earlier runs
reported). Ceilings at the same size: a read-only pass over the same K and V (a torch sum).
Run through `gpu_check.py` (`--parts attention`).
"""
from __future__ import annotations

from cuda_timing import events_ms, graph_ms, host_ms
from kernel_bandwidth import paged_kv


def _time(fn, sizes) -> float:
    return host_ms(fn, runs=1) if sizes.smoke else graph_ms(fn)  # smoke: the code path, not a figure


def _launcher(settings: dict):
    """(launcher, its keyword settings) for a sweep row's settings, less the partition size."""
    from pdserve.kernels import paged_attention as pa
    from pdserve.kernels.paged_attention_all_heads import paged_decode_attention_all_heads

    rest = {k: v for k, v in settings.items() if k not in ("partition_size", "all_heads")}
    return (paged_decode_attention_all_heads if settings.get("all_heads")
            else pa.paged_decode_attention_with_partitions), rest


def part_attention(sizes, report: dict) -> dict:
    import torch

    from pdserve.kernels import paged_attention as pa

    peak = report["peak_tbps"]
    copy = report.get("env", {}).get("copy_tbps")
    seqs, context, heads, kv_heads, head_dim = sizes.attn
    dt = torch.float16 if sizes.smoke else torch.bfloat16  # the interpreter has no bf16 products
    kc, vc, tables, lens = paged_kv(seqs, context, kv_heads, head_dim, 16, dt, sizes.device, seed=1)
    q = torch.randn(seqs, heads, head_dim, device=sizes.device, dtype=dt)
    want = pa.paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125).float()
    moved = (kc.numel() + vc.numel() + 2 * q.numel()) * q.element_size() + tables.numel() * 4 + lens.numel() * 4
    rate = lambda ms: moved / (ms * 1e-3) / 1e12  # noqa: E731

    def row(ms, err, settings) -> dict:
        return dict(ms=ms, tbps=rate(ms), share_of_peak=rate(ms) / peak,
                    share_of_copy=rate(ms) / copy if copy else None, rel_err=err, ok=err < 1e-2, settings=settings)

    def launcher_fn(settings: dict):
        partition = settings.get("partition_size")
        if partition is None:
            return lambda: pa.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
        launcher, rest = _launcher(settings)
        return lambda: launcher(q, kc, vc, tables, lens, 0.125, partition, **rest)

    def measure(**settings) -> dict:
        fn = launcher_fn(settings)
        err = ((fn().float() - want).norm() / want.norm()).item()
        return row(_time(fn, sizes), err, dict(settings, partition_size=settings.get("partition_size")))

    # the default launcher, three ways
    chosen = pa.choose_partition_size(seqs, kv_heads, tables.shape[1] * 16, q.device, head_dim)
    default = measure()
    default_fn = launcher_fn({})
    timings = dict(graph_flushed=default["ms"])
    if not sizes.smoke:
        timings.update(graph_warm_l2=graph_ms(default_fn, flush=False), eager_do_bench=events_ms(default_fn))
    # the goal is met only if the worst of several timings meets it: four more of the default
    repeats = [default["ms"]] + ([] if sizes.smoke else [graph_ms(default_fn) for _ in range(4)])
    worst_share = rate(max(repeats)) / peak
    ceilings = {}
    if not sizes.smoke:  # what a plain read of the same bytes gets at this size
        ceilings["read_tbps"] = (kc.numel() + vc.numel()) * 2 / (graph_ms(lambda: (kc.sum(), vc.sum())) * 1e-3) / 1e12
    print(f"  default launcher (partition {chosen}): {default['ms'] * 1e3:.1f} us, {default['tbps']:.2f} TB/s = "
          f"{100 * default['share_of_peak']:.1f}% of {peak} TB/s; rel err {default['rel_err']:.1e}  "
          f"(goal >= 70% of peak in this timing: {'met' if default['share_of_peak'] >= 0.7 else 'NOT met'})")
    if len(repeats) > 1:
        print(f"    repeats (us): {', '.join(f'{ms * 1e3:.1f}' for ms in repeats)}; worst {100 * worst_share:.1f}% of "
              f"peak (goal {'met' if worst_share >= 0.7 else 'NOT met'} in every repeat)")
    print("    timed three ways (us): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in timings.items())
          + "".join(f"; a torch read of the same K/V {v:.2f} TB/s" for v in ceilings.values()))
    sweep = []

    def trial(**settings):
        try:
            r = measure(**settings)
        except Exception as exc:  # a setting the compiler refuses (shared memory, say) is a finding, not a stop
            r = dict(settings=settings, error=f"{type(exc).__name__}: {str(exc)[:300]}", tbps=0.0, ok=False)
        sweep.append(r)
        print(f"    {str(r['settings']):110s} " + (f"{r['ms'] * 1e3:7.1f} us {r['tbps']:5.2f} TB/s err {r['rel_err']:.1e}"
                                                  if "ms" in r else r["error"]))
        return r

    best = lambda rows: max((r for r in rows if r["ok"]), key=lambda r: r["tbps"], default=None)  # noqa: E731
    small = sizes.smoke
    partitions = (0, 32) if small else (0, 256, 512, 1024)
    # 1. one pass with and without the next tile prefetched; split-K with and without the fused
    #    reduce (the last partition merges: no reduce kernel), in both grid orders; 128-token tiles
    bn = 32 if small else 128
    stage1 = [trial(partition_size=0, block_n=bn, prefetch=pf, cache_dtype_dots=True) for pf in (False, True)]
    stage1 += [trial(partition_size=p, block_n=bn, fused_reduce=fr, heads_first=hf, cache_dtype_dots=True)
               for p in partitions[1:] for fr in (False, True) for hf in (False, True)]
    # 2. warps and stages on the two best of stage 1
    ranked = [r["settings"] for r in sorted((r for r in stage1 if r["ok"]), key=lambda r: -r["tbps"])]
    stage2 = [trial(**{k: v for k, v in top.items() if k not in ("num_warps", "num_stages")}, num_warps=w, num_stages=s)
              for top in ranked[:2] for w in (4, 8) for s in (2, 3)]
    # 3. every KV head of a sequence in one program (`paged_attention_all_heads.py`)
    stage3 = [trial(all_heads=True, partition_size=32 if small else 256, block_n=16, num_warps=4, num_stages=2)]
    overall = best(stage1 + stage2 + stage3)
    if overall:
        print(f"  best: {overall['settings']}: {overall['tbps']:.2f} TB/s = {100 * overall['share_of_peak']:.1f}% of peak")
    shapes = _by_shape(sizes, overall, kv_heads, heads, head_dim, q.device) if overall and not small else []
    extra = {}
    if not small:  # Llama-3-8B's shape too (head_dim 128): the default launcher and a few tiles
        kc8, vc8, t8, l8 = paged_kv(32, 2048, 8, 128, 16, dt, sizes.device, seed=2)
        q8 = torch.randn(32, 32, 128, device=sizes.device, dtype=dt)
        nbytes = (kc8.numel() + vc8.numel() + 2 * q8.numel()) * 2
        ms = graph_ms(lambda: pa.paged_decode_attention(q8, kc8, vc8, t8, l8, 0.088))
        extra = dict(shape="b32 ctx2048 32/8 heads d128", ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12,
                     chosen=pa.choose_partition_size(32, 8, 2048, q8.device, 128), sweep=[])
        extra["share_of_peak"] = extra["tbps"] / peak
        print(f"  head_dim 128 (Llama-3-8B's shape), default launcher (partition {extra['chosen']}): {ms * 1e3:.1f} us, "
              f"{extra['tbps']:.2f} TB/s = {100 * extra['share_of_peak']:.1f}% of peak")
        for p, bn, pf, fr in ((0, 32, True, False), (0, 64, True, False), (0, 64, False, False),
                              (512, 64, False, True), (1024, 64, False, True)):
            try:
                ms = graph_ms(lambda: pa.paged_decode_attention_with_partitions(
                    q8, kc8, vc8, t8, l8, 0.088, p, block_n=bn, cache_dtype_dots=True, prefetch=pf, fused_reduce=fr))
                extra["sweep"].append(dict(partition_size=p, block_n=bn, prefetch=pf, fused_reduce=fr, ms=ms,
                                           tbps=nbytes / (ms * 1e-3) / 1e12))
                print(f"    d128 partition {p} block_n {bn} prefetch {pf} fused reduce {fr}: {ms * 1e3:.1f} us, "
                      f"{nbytes / (ms * 1e-3) / 1e12:.2f} TB/s")
            except Exception as exc:  # shared memory, say
                extra["sweep"].append(dict(partition_size=p, block_n=bn, error=f"{type(exc).__name__}: {exc}"[:300]))
                print(f"    d128 partition {p} block_n {bn}: {type(exc).__name__}")
    return dict(batch=seqs, context=context, heads=heads, kv_heads=kv_heads, head_dim=head_dim, bytes=moved,
                timer="graph_flushed", default=dict(default, partition_size=chosen), default_timings=timings,
                ceilings=ceilings, default_repeats_ms=repeats, worst_share_of_peak=worst_share,
                goal_met=worst_share >= 0.7 and default["ok"],
                sweep=sweep, best=overall, by_shape=shapes, head_dim_128=extra, ok=default["ok"])


def _by_shape(sizes, overall: dict, kv_heads: int, heads: int, head_dim: int, device) -> list[dict]:
    """TB/s by partition size at other batches and contexts, with the sweep's best other
    settings, and the default launcher's: what `choose_partition_size` should pick."""
    import torch

    from pdserve.kernels import paged_attention as pa

    launcher, rest = _launcher(overall["settings"])
    shapes = []
    for num_seqs, ctx in ((1, 4096), (8, 4096), (32, 2048), (64, 2048), (128, 1024), (32, 512)):
        kc, vc, t, lens = paged_kv(num_seqs, ctx, kv_heads, head_dim, 16, torch.bfloat16, sizes.device, seed=3)
        q = torch.randn(num_seqs, heads, head_dim, device=sizes.device, dtype=torch.bfloat16)
        nbytes = (kc.numel() + vc.numel() + 2 * q.numel()) * 2
        r = dict(num_seqs=num_seqs, context=ctx, chosen=pa.choose_partition_size(num_seqs, kv_heads, ctx, device, head_dim))
        for p in (0, 128, 256, 512, 1024, 2048):
            if p >= ctx or p % rest.get("block_n", 32):
                continue
            ms = graph_ms(lambda: launcher(q, kc, vc, t, lens, 0.125, p, **rest))
            r[f"p{p}_tbps"] = nbytes / (ms * 1e-3) / 1e12
        r["default_tbps"] = nbytes / (graph_ms(lambda: pa.paged_decode_attention(q, kc, vc, t, lens, 0.125)) * 1e-3) / 1e12
        shapes.append(r)
        print("    b%-4d ctx%-5d " % (num_seqs, ctx) + "  ".join(f"{k} {v:.2f}" for k, v in r.items()
                                                           if k.endswith("tbps")) + f"  (default picks {r['chosen']})")
        del kc, vc
    return shapes

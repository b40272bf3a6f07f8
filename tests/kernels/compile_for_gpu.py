"""Compile every Triton kernel's launches for an NVIDIA GPU on a machine without one.

    python tests/kernels/compile_for_gpu.py [--arch 90] [--shard 0/2]

CI runs the kernels through Triton's interpreter, which accepts code the compiler refuses (and
computes bf16 products its own way), so a kernel could pass every test here and fail to build on
a GPU. This script puts a stand-in driver in place of CUDA's that names the target (sm_90: the
H100 and H200), turns each launch into a compile-only warm-up, and calls every launcher at the
dtypes and shapes the engine uses: Triton's front end, its passes and ptxas (which the triton
wheel carries) all run, so a kernel that cannot compile fails here. Nothing is executed, so the
outputs are garbage: the launchers' Python runs on uninitialised CPU tensors.

Run in a process of its own: TRITON_INTERPRET must be unset when triton is imported.
`tests/kernels/test_compile_for_gpu.py` runs it as two shards at once (`--shard`: every other
launch each), one a core: cold, the whole took 106 s in a CI run on a 2-core AMD EPYC.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import traceback


def install_stand_in_driver(arch: int) -> list:
    """The stand-in driver, and launches made compile-only; returns the list each compiled
    kernel is appended to (name, metadata)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class StandInDriver:  # what JITFunction.run asks the driver for before it compiles
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(StandInDriver())
    compiled = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel.metadata))
        return kernel

    JITFunction.run = compile_only
    return compiled


def launch_everything(shard: int = 0, num_shards: int = 1) -> list[str]:
    """Every launcher at the engine's dtypes and head sizes (with shards, this shard's: every
    num_shards-th launch from the shard-th); the failures, described."""
    import torch

    from pdserve.kernels import extend_attention as ea, kv_write, paged_attention as pa, rmsnorm, rotary, sampling
    from pdserve.kernels.paged_attention_all_heads import paged_decode_attention_all_heads

    failures, launches = [], itertools.count()

    def attempt(name, fn):
        if next(launches) % num_shards != shard:
            return
        try:
            fn()
        except Exception as exc:  # a refusal by the compiler: reported, and the rest still tried
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:1500]}\n{traceback.format_exc(limit=4)}")

    def paged(num_seqs, context, kv_heads, head_dim, dtype):
        blocks = -(-context // 16)
        cache = torch.empty(num_seqs * blocks, 16, kv_heads, head_dim, dtype=dtype)
        tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
        return cache, cache.clone(), tables, torch.full((num_seqs,), context, dtype=torch.int32)

    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for hidden in (64, 2048):
            x, w = torch.randn(8, hidden, dtype=dt), torch.ones(hidden, dtype=dt)
            attempt(f"rms_norm {dt} {hidden}", lambda: rmsnorm.rms_norm(x, w, 1e-5))
            attempt(f"fused_add_rms_norm {dt} {hidden}", lambda: rmsnorm.fused_add_rms_norm(x, x.clone(), w, 1e-5))
        for d in (64, 128):
            qk = torch.randn(8, 40, d, dtype=dt)
            cos, sin = rotary.rope_at(*rotary.build_rope_cache(d, 4096, 500000.0), torch.arange(8), dt)
            attempt(f"apply_rotary {dt} d{d}", lambda: rotary.apply_rotary(qk, cos, sin))
            kc, vc, tables, lens = paged(4, 64, 8, d, dt)
            k = torch.randn(8, 8, d, dtype=dt)
            attempt(f"write_kv {dt} d{d}", lambda: kv_write.write_kv(k, k, kc, vc, torch.arange(8)))
            for num_seqs in (1, 32):  # the default launcher: split-K and one pass
                kc2, vc2, t2, l2 = paged(num_seqs, 4096, 8, d, dt)
                q = torch.randn(num_seqs, 32, d, dtype=dt)
                attempt(f"paged_decode_attention {dt} d{d} b{num_seqs}",
                        lambda: pa.paged_decode_attention(q, kc2, vc2, t2, l2, 0.1))
            q = torch.randn(4, 32, d, dtype=dt)
            for partition, settings in (  # what gpu_check.py sweeps
                    (128, dict(block_n=64, num_warps=8, num_stages=2, heads_first=True)),
                    (128, dict(block_n=128, cache_dtype_dots=True, fused_reduce=True)),
                    (0, dict(block_n=128, cache_dtype_dots=True, prefetch=True)),
                    (128, dict(block_n=64, prefetch=True))):
                attempt(f"paged_decode_attention {dt} d{d} p{partition} {settings}",
                        lambda: pa.paged_decode_attention_with_partitions(q, kc, vc, tables, lens, 0.1, partition,
                                                                          **settings))
            attempt(f"paged_decode_attention_all_heads {dt} d{d}",
                    lambda: paged_decode_attention_all_heads(q, kc, vc, tables, lens, 0.1, 32, block_n=16))
            for cu in ([0, 5, 10, 15, 20], [0, 100, 200, 300, 400]):  # verification; prefill chunks
                qe = torch.randn(cu[-1], 32, d, dtype=dt)
                cu_t = torch.tensor(cu, dtype=torch.int32)
                attempt(f"extend_attention {dt} d{d} {cu[-1]} tokens",
                        lambda: ea.extend_attention(qe, kc, vc, tables, cu_t, lens, 0.1))
                for settings in (dict(cache_dtype_dots=False), dict(block_m=128, block_n=128, num_warps=8),
                                 dict(block_m=64, block_n=64, num_warps=4)):  # what gpu_check.py sweeps
                    attempt(f"extend_attention {dt} d{d} {cu[-1]} tokens {settings}",
                            lambda: ea.extend_attention_with_settings(qe, kc, vc, tables, cu_t, lens, 0.1, **settings))
    for vocab in (1000, 128256):
        logits = torch.randn(4, vocab)
        params = (torch.full((4,), 0.8), torch.full((4,), 50, dtype=torch.int64), torch.full((4,), 0.9),
                  torch.full((4,), 0.05))
        attempt(f"filter_probs {vocab}", lambda: sampling.filter_probs(logits, *params))
        attempt(f"sample {vocab}", lambda: sampling.sample(logits, *params, torch.rand(4, vocab)))
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="the compute capability, times ten (90: sm_90)")
    ap.add_argument("--shard", default="0/1", help="I/N: only every N-th launch, from the I-th (default: all)")
    args = ap.parse_args(argv)
    try:
        shard, num_shards = map(int, args.shard.split("/"))
    except ValueError:
        ap.error(f"--shard must be I/N, got {args.shard!r}")
    if not 0 <= shard < num_shards:
        ap.error(f"--shard I/N needs 0 <= I < N, got {args.shard!r}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles the kernels", file=sys.stderr)
        return 2
    compiled = install_stand_in_driver(args.arch)
    failures = launch_everything(shard, num_shards)
    for failure in failures:
        print("FAILED", failure)
    kinds = sorted({name for name, _ in compiled})
    print(f"compiled {len(compiled)} launches of {len(kinds)} kernels for sm_{args.arch}: {', '.join(kinds)}; "
          f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

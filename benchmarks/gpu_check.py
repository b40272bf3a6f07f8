"""The prepared check for a CUDA machine. UNTESTED ON HARDWARE: no GPU was available while it
was written (this project's CI and development machines are CPU-only).

    python benchmarks/gpu_check.py [--out benchmarks/results] [--peak-tbps 4.8] [--skip-tests] [--skip-model]

Meant to finish in under ~8 minutes on one H200. Three parts, each reported as it finishes:

1. **Kernels, compiled**: the kernel tests (`tests/kernels`, the same ones CI runs through
   Triton's interpreter on the CPU) with TRITON_INTERPRET unset, so every Triton kernel is
   compiled for the GPU and checked against its torch reference; then each op once more at
   serving sizes (bf16), kernel against reference.
2. **Paged decode attention bandwidth**: batch 32, 2048-token contexts, Llama-3.2-1B's attention
   shape (32 query heads, 8 KV heads, head_dim 64, bf16, 16-token blocks): bytes read (K, V, q)
   and written / median kernel time, as a share of the device's peak (goal: >= 70%).
3. **Decode tokens/s of a ~1B-parameter Llama** (Llama-3.2-1B's config, random weights, bf16),
   batch 1 and batch 32, with CUDA graphs and without; greedy tokens compared between the two.

Writes `gpu_check.json` (and prints every figure) under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "A10": 0.6}  # HBM/GDDR peaks, TB/s
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def run_kernel_tests(timeout_s: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    pytest = Path(sys.executable).parent / "pytest"
    start = time.perf_counter()
    proc = subprocess.run([str(pytest), "-q", "tests/kernels", "-p", "no:cacheprovider"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    print("kernel tests (compiled):", " / ".join(tail))
    return dict(returncode=proc.returncode, summary=tail, seconds=time.perf_counter() - start)


def check_ops_at_serving_sizes() -> list[dict]:
    """Every Triton op against its reference once, bf16, at sizes a 1B model serves."""
    import torch

    from pdserve.kernels import extend_attention as ea, kv_write, paged_attention as pa, rmsnorm, rotary, sampling

    dev, dt, out = "cuda", torch.bfloat16, []
    torch.manual_seed(0)

    def compare(name, got, want, atol, rtol):
        err = (got.float() - want.float()).abs().max().item()
        ok = torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol)
        out.append(dict(op=name, max_abs_err=err, ok=ok))
        print(f"  {name:40s} max |err| {err:.3g}  {'ok' if ok else 'MISMATCH'}")

    x, r, w = torch.randn(512, 2048, device=dev, dtype=dt), torch.randn(512, 2048, device=dev, dtype=dt), \
        torch.rand(2048, device=dev, dtype=dt)
    compare("rms_norm", rmsnorm.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_ref(x, w, 1e-5), 2e-2, 2e-2)
    compare("fused_add_rms_norm", rmsnorm.fused_add_rms_norm(x, r, w, 1e-5)[0],
            rmsnorm.fused_add_rms_norm_ref(x, r, w, 1e-5)[0], 2e-2, 2e-2)
    qk = torch.randn(512, 40, 64, device=dev, dtype=dt)
    cos, sin = rotary.rope_at(*(t.to(dev) for t in rotary.build_rope_cache(64, 4096, 500000.0)),
                              torch.randint(0, 4096, (512,), device=dev), dt)
    compare("apply_rotary", rotary.apply_rotary(qk, cos, sin), rotary.apply_rotary_ref(qk, cos, sin), 1e-2, 1e-2)
    kc, vc, tables, lens = _paged(32, 2048, 8, 64, 16, dt, dev)
    q = torch.randn(32, 32, 64, device=dev, dtype=dt)
    compare("paged_decode_attention b32 ctx2048", pa.paged_decode_attention(q, kc, vc, tables, lens, 0.125),
            pa.paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125), 1e-2, 8e-3)
    k_new, slots = torch.randn(512, 8, 64, device=dev, dtype=dt), torch.randperm(kc.shape[0] * 16, device=dev)[:512]
    kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    kv_write.write_kv(k_new, k_new, kc2, vc2, slots)
    kv_write.write_kv_ref(k_new, k_new, kc3, vc3, slots)
    compare("write_kv", kc2, kc3, 0, 0)
    cu = torch.arange(0, 4 * 5 + 1, 5, dtype=torch.int32, device=dev)  # verification: 5 queries per sequence
    qe = torch.randn(20, 32, 64, device=dev, dtype=dt)
    compare("extend_attention (verify 4x5)", ea.extend_attention(qe, kc, vc, tables[:4], cu, lens[:4], 0.125),
            ea.extend_attention_ref(qe, kc, vc, tables[:4], cu, lens[:4], 0.125), 2e-2, 1.6e-2)
    logits = torch.randn(64, 128256, device=dev)
    params = (torch.full((64,), 0.8, device=dev), torch.full((64,), 50, device=dev, dtype=torch.int64),
              torch.full((64,), 0.9, device=dev), torch.full((64,), 0.05, device=dev))
    compare("filter_probs", sampling.filter_probs(logits, *params), sampling.filter_probs_ref(logits, *params), 1e-6, 1e-4)
    noise = -torch.rand(64, 128256, device=dev).log()
    got, want = sampling.sample(logits, *params, noise), sampling.sample_ref(logits, *params, noise)
    out.append(dict(op="sample (race)", agreement=(got == want).float().mean().item(), ok=bool((got == want).all())))
    print(f"  {'sample (race)':40s} agreement {(got == want).float().mean().item():.3f}")
    return out


def _paged(num_seqs, context, num_kv_heads, head_dim, block_size, dtype, dev):
    import torch

    blocks = -(-context // block_size)
    k_cache = torch.randn(num_seqs * blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_seqs * blocks, device=dev).view(num_seqs, blocks).to(torch.int32)
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device=dev)
    return k_cache, v_cache, tables, lens


def attention_bandwidth(peak_tbps: float) -> dict:
    import torch
    from triton.testing import do_bench

    from pdserve.kernels import paged_attention as pa

    dt, num_seqs, context = torch.bfloat16, 32, 2048
    kc, vc, tables, lens = _paged(num_seqs, context, 8, 64, 16, dt, "cuda")
    q = torch.randn(num_seqs, 32, 64, device="cuda", dtype=dt)
    ms = do_bench(lambda: pa.paged_decode_attention(q, kc, vc, tables, lens, 0.125), warmup=50, rep=500)
    moved = (kc.numel() + vc.numel() + 2 * q.numel()) * q.element_size() + tables.numel() * 4
    gbps = moved / (ms * 1e-3) / 1e9
    share = gbps / (peak_tbps * 1e3)
    print(f"paged decode attention b{num_seqs} ctx{context}: {ms * 1e3:.1f} us, {gbps:.0f} GB/s, "
          f"{100 * share:.1f}% of {peak_tbps} TB/s (goal >= 70%: {'met' if share >= 0.7 else 'NOT met'})")
    return dict(batch=num_seqs, context=context, ms=ms, bytes=moved, gbps=gbps, peak_tbps=peak_tbps, share=share,
                goal_met=share >= 0.7)


def decode_throughput(tmp: Path) -> dict:
    import torch
    import transformers

    from pdserve.engine import LLM, SamplingParams

    path = tmp / "llama-1b-random"
    start = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B)).to(torch.bfloat16)
    model.save_pretrained(path)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    print(f"built a {num_params / 1e9:.2f} B-parameter Llama in {time.perf_counter() - start:.0f} s")
    prompts = [[(7 * i + 13 * j) % 32000 + 3 for j in range(128)] for i in range(32)]
    result = dict(num_params=num_params)
    tokens = {}
    for capture in ("cuda_graphs", "off"):
        start = time.perf_counter()
        llm = LLM(str(path), dtype="bfloat16", graph_capture=capture, max_num_seqs=32, kv_cache_memory_bytes=8 << 30)
        startup = time.perf_counter() - start
        row = dict(startup_seconds=startup)
        for batch, new in ((1, 256), (32, 128)):
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            first = llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            t1 = time.perf_counter()
            outs = llm.generate(prompts[:batch], params)
            t2 = time.perf_counter()
            decode_s = (t2 - t1) - (t1 - t0)  # the prefill and first token, taken out
            row[f"batch{batch}_decode_tokens_per_s"] = batch * (new - 1) / decode_s
            tokens[(capture, batch)] = [o.token_ids for o in outs]
            del first
        print(f"  graph_capture={capture:12s} start-up {startup:5.1f} s   batch 1: "
              f"{row['batch1_decode_tokens_per_s']:7.1f} tok/s   batch 32: {row['batch32_decode_tokens_per_s']:8.1f} tok/s")
        result[capture] = row
        del llm
        torch.cuda.empty_cache()
    result["greedy_identical"] = {b: tokens[("cuda_graphs", b)] == tokens[("off", b)] for b in (1, 32)}
    result["cuda_graph_speedup"] = {f"batch{b}": result["cuda_graphs"][f"batch{b}_decode_tokens_per_s"]
                                    / result["off"][f"batch{b}_decode_tokens_per_s"] for b in (1, 32)}
    print(f"  CUDA graphs: x{result['cuda_graph_speedup']['batch1']:.2f} at batch 1, "
          f"x{result['cuda_graph_speedup']['batch32']:.2f} at batch 32; greedy identical: {result['greedy_identical']}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "benchmarks" / "results")))
    ap.add_argument("--peak-tbps", type=float, default=None, help="device peak bandwidth (default: by device name)")
    ap.add_argument("--skip-tests", action="store_true", help="skip the compiled kernel tests (part 1a)")
    ap.add_argument("--skip-model", action="store_true", help="skip the 1B-parameter model (part 3)")
    ap.add_argument("--test-timeout", type=int, default=240)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu_check.py needs CUDA; there is none here, so nothing was checked.")
        return 0
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: this check compiles the kernels"
    name = torch.cuda.get_device_name()
    peak = args.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in name), 4.8)
    print(f"device: {name}; peak bandwidth taken as {peak} TB/s")
    report = dict(device=name, peak_tbps=peak, torch=torch.__version__, command=" ".join(sys.argv))
    start = time.perf_counter()
    if not args.skip_tests:
        report["kernel_tests"] = run_kernel_tests(args.test_timeout)
    print("ops at serving sizes (bf16), compiled kernel vs reference:")
    report["ops"] = check_ops_at_serving_sizes()
    report["attention_bandwidth"] = attention_bandwidth(peak)
    if not args.skip_model:
        with tempfile.TemporaryDirectory() as tmp:
            report["decode"] = decode_throughput(Path(tmp))
    report["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out / 'gpu_check.json'} after {report['seconds']:.0f} s")
    failed = (report.get("kernel_tests", {}).get("returncode", 0) != 0) or not all(o["ok"] for o in report["ops"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

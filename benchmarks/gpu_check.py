"""The check for a CUDA machine, as one prepared run (issue 14's "on a GPU" list).

    python benchmarks/gpu_check.py [--out DIR] [--parts env,ops,attention,decode,spec,sampling,kernels,tests]
    python benchmarks/gpu_check.py --smoke        # the same code on the CPU, tiny sizes, interpreted kernels

The model parts live in `gpu_model.py`, the attention part in `gpu_attention.py`, the tables
and plot in `gpu_report.py`. About three minutes on one H200 (BENCHMARKS.md, GPU). Each part is
reported as it finishes, and `gpu_check.json` under --out is rewritten after every part, so a run
cut short keeps what it did. A part that fails records its error and the run goes on.

- **env**: device, versions, and the two ceilings measured here: a device-to-device copy
  (bytes read + written / time) and a bf16 matrix product.
- **tests**: the kernel tests (`tests/kernels`' Triton ones, which CI runs through Triton's
  interpreter) with TRITON_INTERPRET unset, so every kernel is compiled for the GPU and checked
  against its torch reference.
- **ops**: every Triton op once more at serving sizes (bf16), kernel against reference.
- **attention**: paged decode attention at batch 32, 2048-token contexts, Llama-3.2-1B's shape
  (32 query heads, 8 KV heads, head_dim 64, bf16, 16-token blocks): bytes (K, V, q read, out
  written) / median time of CUDA-graph replays from a cold L2 (`cuda_timing.py`), as a share of
  the datasheet peak and of the measured copy; goal >= 70% of the peak in the worst of five
  timings. Then a sweep of the launcher's settings (partition size, prefetch, fused reduce, grid
  order, warps, stages), each checked against the reference before it is timed
  (`gpu_attention.py`).
- **extend**: the prefill attention kernel against dense SDPA at Llama-3.2-1B's heads (a chunked
  prefill, a fresh prompt, speculative verification) and a sweep of its tiles, warps and 16-bit
  products, each checked against the reference before it is timed (`gpu_extend.py`).
- **sampling**: the fused sample kernel against torch's reference at 1, 32 and 128 rows of a
  128k vocabulary, with no filter, top-p, and top-k + top-p + min-p (eager timings: sampling
  runs outside the captured step). The CUDA backend samples with the reference while the
  kernel loses here.
- **kernels**: `kernel_bandwidth.py`'s table (every op against its torch reference).
- **decode**: a Llama-architecture model of Llama-3.2-1B's config with random weights (bf16, no
  download): decode tokens/s at batch 1 and 32, with CUDA graphs and without, greedy tokens
  compared between the two, the step against its floor (weight bytes / measured copy
  bandwidth), and transformers' `generate` on the same weights at batch 1.
- **spec**: the same model with n-gram speculation (k = 4) at batch 1, greedy, against plain
  decoding: tokens/s and whether the tokens agree.
- **spec_demo**: the committed demo pair (trained, so its draft is accepted) with CUDA graphs:
  draft k = 4, draft adaptive and n-gram adaptive against plain decoding at batch 1, 8 and 32,
  greedy and temperature 1, interleaved repeats, tokens compared (`gpu_spec.py`).
- **serving**: the engine's and the serving tests on CUDA (`SERVING_TESTS`): the engine against
  transformers, speculation against plain decoding, CUDA graphs, the gpu-marked tests, and real
  prefill, decode and router processes whose KV caches are on the GPU (a prefill's K/V stream
  out layer by layer inside the forward pass), tokens against the offline engine's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below, however this one is loaded

from cuda_timing import events_ms, host_ms  # noqa: E402
from gpu_attention import part_attention  # noqa: E402
from gpu_model import part_decode, part_spec  # noqa: E402
from gpu_extend import part_extend  # noqa: E402
from gpu_spec import part_spec_demo  # noqa: E402
from kernel_bandwidth import paged_kv  # noqa: E402
from gpu_report import render  # noqa: E402

PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "A10": 0.6}  # datasheet HBM/GDDR peaks, TB/s
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# --smoke: the same parts on the CPU at sizes the interpreter gets through in seconds
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=211, max_position_embeddings=512, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
KERNEL_TESTS = ["tests/kernels/test_kernel_extend_attention.py", "tests/kernels/test_kernel_kv_write.py",
                "tests/kernels/test_kernel_ops_selection.py", "tests/kernels/test_kernel_paged_attention.py",
                "tests/kernels/test_kernel_rmsnorm.py", "tests/kernels/test_kernel_rotary.py",
                "tests/kernels/test_kernel_sampling.py", "tests/kernels/test_gathered_attention.py",
                "tests/kernels/test_engine_triton_backend.py"]
# the engine and the serving processes on CUDA (device "auto" picks it): these tests' engines,
# workers and routers are what runs, on the GPU
SERVING_TESTS = ["tests/engine/test_gpu_marker.py", "tests/engine/test_sampler.py", "tests/engine/test_capture.py",
                 "tests/engine/test_model_vs_transformers.py", "tests/engine/test_spec_decode.py",
                 "tests/engine/test_disagg.py", "tests/disagg/test_disagg_e2e.py"]
PARTS = ("env", "ops", "attention", "extend", "spec_demo", "serving", "decode", "spec", "sampling", "kernels", "tests")


class Sizes:
    """What a part runs at: serving sizes on a GPU, toy sizes for --smoke."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.rows, self.hidden, self.vocab = (8, 64, 1000) if smoke else (512, 2048, 128256)
        self.attn = (2, 40, 4, 2, 16) if smoke else (32, 2048, 32, 8, 64)  # seqs, context, heads, kv heads, head_dim
        self.copy_bytes = 1 << 20 if smoke else 2 << 30
        self.matmul = 64 if smoke else 8192
        self.model = TINY_LLAMA if smoke else LLAMA_1B
        self.prompt_len, self.batches = (8, ((1, 6), (4, 4))) if smoke else (128, ((1, 256), (32, 128)))


def timer(fn, sizes: Sizes, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds of fn(): CUDA events through Triton's do_bench; host clock for --smoke."""
    return host_ms(fn, runs=1) if sizes.smoke else events_ms(fn, warmup_ms, rep_ms)  # smoke: the code path, not a figure


# --- env ----------------------------------------------------------------------------------

def part_env(sizes: Sizes, report: dict) -> dict:
    import torch
    import triton

    out = dict(torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0])
    if not sizes.smoke:
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, multiprocessors=props.multi_processor_count,
                   memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}")
    src = torch.empty(sizes.copy_bytes // 2, dtype=torch.bfloat16, device=sizes.device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), sizes)
    out["copy_tbps"] = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12  # read + written
    n = sizes.matmul
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=sizes.device) for _ in range(2))
    ms = timer(lambda: a @ b, sizes)
    out["bf16_matmul_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    print(f"  {out.get('device', 'cpu')}: copy {out['copy_tbps']:.2f} TB/s (read + written), "
          f"bf16 matmul {out['bf16_matmul_tflops']:.0f} TFLOP/s; torch {out['torch']}, triton {out['triton']}")
    return out


# --- tests --------------------------------------------------------------------------------

def part_tests(sizes: Sizes, report: dict, out_dir: Path, timeout_s: int = 180, tests: list[str] = KERNEL_TESTS,
               log_name: str = "gpu_check_kernel_tests.log", by_file: bool = False) -> dict:
    """by_file: each test file on one xdist worker (a file's session fixtures, its servers, start once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if sizes.smoke:
        return dict(skipped="--smoke: CI runs these tests on the CPU")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", *tests]
    try:
        import xdist  # noqa: F401  (compiles in parallel: most of this part is Triton compiling)

        cmd += ["-n", "8"] + (["--dist", "loadfile"] if by_file else [])
    except ImportError:
        pass
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        returncode, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # keep what it printed
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        returncode, log = f"timed out after {timeout_s} s", "".join(text)
    (out_dir / log_name).write_text(log)
    tail = [line for line in log.strip().splitlines() if " passed" in line or " failed" in line][-1:]
    failed = [line for line in log.splitlines() if line.startswith("FAILED")]
    print("  " + " / ".join(tail))
    for line in failed[:10]:
        print("  " + line)
    return dict(returncode=returncode, summary=tail, failed=failed, seconds=time.perf_counter() - start,
                ok=returncode == 0)


# --- ops ----------------------------------------------------------------------------------

def part_ops(sizes: Sizes, report: dict) -> dict:
    """Every Triton op against its reference once, bf16, at sizes a 1B model serves."""
    import torch

    from pdserve.kernels import extend_attention as ea, kv_write, paged_attention as pa, rmsnorm, rotary, sampling

    dev, rows, hidden, vocab = sizes.device, sizes.rows, sizes.hidden, sizes.vocab
    dt = torch.float16 if sizes.smoke else torch.bfloat16  # the interpreter has no bf16 products
    seqs, context, heads, kv_heads, head_dim = sizes.attn
    checks = []
    torch.manual_seed(0)

    def compare(name, got, want, atol, rtol):
        err = (got.float() - want.float()).abs().max().item()
        ok = bool(torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol)) and not got.float().isnan().any().item()
        checks.append(dict(op=name, max_abs_err=err, ok=ok))
        print(f"  {name:40s} max |err| {err:.3g}  {'ok' if ok else 'MISMATCH'}")

    x, r = (torch.randn(rows, hidden, device=dev, dtype=dt) for _ in range(2))
    w = torch.rand(hidden, device=dev, dtype=dt)
    compare("rms_norm", rmsnorm.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_ref(x, w, 1e-5), 2e-2, 2e-2)
    compare("fused_add_rms_norm", rmsnorm.fused_add_rms_norm(x, r, w, 1e-5)[0],
            rmsnorm.fused_add_rms_norm_ref(x, r, w, 1e-5)[0], 2e-2, 2e-2)
    qk = torch.randn(rows, heads + kv_heads, head_dim, device=dev, dtype=dt)
    cos, sin = rotary.rope_at(*(t.to(dev) for t in rotary.build_rope_cache(head_dim, 4096, 500000.0)),
                              torch.randint(0, 4096, (rows,), device=dev), dt)
    compare("apply_rotary", rotary.apply_rotary(qk, cos, sin), rotary.apply_rotary_ref(qk, cos, sin), 1e-2, 1e-2)
    kc, vc, tables, lens = paged_kv(seqs, context, kv_heads, head_dim, 16, dt, dev)
    q = torch.randn(seqs, heads, head_dim, device=dev, dtype=dt)
    compare(f"paged_decode_attention b{seqs} ctx{context}", pa.paged_decode_attention(q, kc, vc, tables, lens, 0.125),
            pa.paged_decode_attention_ref(q, kc, vc, tables, lens, 0.125), 1e-2, 8e-3)
    n_new = min(rows, kc.shape[0] * 16)
    k_new = torch.randn(n_new, kv_heads, head_dim, device=dev, dtype=dt)
    slots = torch.randperm(kc.shape[0] * 16, device=dev)[:n_new]
    kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    kv_write.write_kv(k_new, k_new, kc2, vc2, slots)
    kv_write.write_kv_ref(k_new, k_new, kc3, vc3, slots)
    compare("write_kv", kc2, kc3, 0, 0)
    verify = min(seqs, 4)
    cu = torch.arange(0, verify * 5 + 1, 5, dtype=torch.int32, device=dev)  # verification: 5 queries per sequence
    qe = torch.randn(verify * 5, heads, head_dim, device=dev, dtype=dt)
    compare(f"extend_attention (verify {verify}x5)",
            ea.extend_attention(qe, kc, vc, tables[:verify], cu, lens[:verify], 0.125),
            ea.extend_attention_ref(qe, kc, vc, tables[:verify], cu, lens[:verify], 0.125), 2e-2, 1.6e-2)
    n = 64 if not sizes.smoke else 4
    logits = torch.randn(n, vocab, device=dev)
    params = (torch.full((n,), 0.8, device=dev), torch.full((n,), 50, device=dev, dtype=torch.int64),
              torch.full((n,), 0.9, device=dev), torch.full((n,), 0.05, device=dev))
    compare("filter_probs", sampling.filter_probs(logits, *params), sampling.filter_probs_ref(logits, *params),
            1e-6, 1e-4)
    noise = -torch.rand(n, vocab, device=dev).log()
    got, want = sampling.sample(logits, *params, noise), sampling.sample_ref(logits, *params, noise)
    agree = (got == want).float().mean().item()
    checks.append(dict(op="sample (race)", agreement=agree, ok=agree == 1.0))
    print(f"  {'sample (race)':40s} agreement {agree:.3f}")
    return dict(checks=checks, ok=all(c["ok"] for c in checks))


# --- sampling -----------------------------------------------------------------------------

SAMPLING_FILTERS = {  # (temperature, top_k, top_p, min_p) per row
    "temperature only": (0.8, 0, 1.0, 0.0),
    "top-p 0.9": (0.8, 0, 0.9, 0.0),
    "top-k 50, top-p 0.9, min-p 0.05": (0.8, 50, 0.9, 0.05),
}


def part_sampling(sizes: Sizes, report: dict) -> dict:
    """The fused sample kernel against torch's reference by rows and filters: one program per
    row, so its time should hardly grow with the rows until they outnumber the multiprocessors."""
    import torch

    from pdserve.kernels import sampling

    vocab, rows_list = (1000, (1, 4)) if sizes.smoke else (128256, (1, 32, 128))
    table = []
    for name, (t, k, p, m) in SAMPLING_FILTERS.items():
        for rows in rows_list:
            dev = sizes.device
            logits = torch.randn(rows, vocab, device=dev) * 3
            params = (torch.full((rows,), t, device=dev), torch.full((rows,), k, device=dev, dtype=torch.int64),
                      torch.full((rows,), p, device=dev), torch.full((rows,), m, device=dev))
            noise = -torch.rand(rows, vocab, device=dev).log()
            agree = (sampling.sample(logits, *params, noise) == sampling.sample_ref(logits, *params, noise)).all().item()
            kernel_ms = timer(lambda: sampling.sample(logits, *params, noise), sizes, rep_ms=100)
            ref_ms = timer(lambda: sampling.sample_ref(logits, *params, noise), sizes, rep_ms=100)
            table.append(dict(filters=name, rows=rows, kernel_ms=kernel_ms, reference_ms=ref_ms, agree=agree))
            print(f"  {name:34s} {rows:4d} rows: kernel {kernel_ms * 1e3:8.1f} us, torch reference "
                  f"{ref_ms * 1e3:8.1f} us ({ref_ms / kernel_ms:.2f}x){'' if agree else '  TOKENS DIFFER'}")
    return dict(vocab=vocab, table=table, ok=all(r["agree"] for r in table))


# --- kernels ------------------------------------------------------------------------------

def part_kernels(sizes: Sizes, report: dict, out_dir: Path) -> dict:
    if sizes.smoke:
        return dict(skipped="--smoke: kernel_bandwidth.py needs CUDA")
    import kernel_bandwidth

    rc = kernel_bandwidth.main(["--out", str(out_dir), "--peak-tbps", str(report["peak_tbps"]),
                                "--peak-name", report.get("env", {}).get("device", "device")])
    return dict(returncode=rc, ok=rc == 0, json=sorted(p.name for p in out_dir.glob("kernels-*.json")))


# --- the run ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks" / "results"))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {PARTS}")
    ap.add_argument("--peak-tbps", type=float, default=None, help="datasheet bandwidth (default: by device name)")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes, kernels interpreted: checks the script")
    ap.add_argument("--test-timeout", type=int, default=180)
    ap.add_argument("--render", type=Path, metavar="DIR",
                    help="only print the tables of a finished run's DIR/gpu_check.json (and draw DIR/gpu_check.png)")
    args = ap.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu_check.py needs CUDA; there is none here, so nothing was checked "
              "(--smoke runs the same code on the CPU at toy sizes).")
        return 0
    if not args.smoke:
        assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: this check compiles the kernels"
    sizes = Sizes(args.smoke)
    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    peak = args.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in name), 4.8)
    print(f"device: {name}; datasheet bandwidth taken as {peak} TB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(device=name, peak_tbps=peak, command="python benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:]),
                        started=time.strftime("%Y-%m-%d %H:%M:%S"))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            print(f"[{part}]", flush=True)
            t0 = time.perf_counter()
            try:
                if part == "env":
                    result = part_env(sizes, report)
                elif part == "tests":
                    result = part_tests(sizes, report, args.out, args.test_timeout)
                elif part == "serving":
                    result = part_tests(sizes, report, args.out, args.test_timeout, SERVING_TESTS,
                                        "gpu_check_serving_tests.log", by_file=True)
                elif part == "extend":
                    result = part_extend(sizes, report)
                elif part == "spec_demo":
                    result = part_spec_demo(sizes, report)
                elif part == "ops":
                    result = part_ops(sizes, report)
                elif part == "attention":
                    result = part_attention(sizes, report)
                elif part == "sampling":
                    result = part_sampling(sizes, report)
                elif part == "kernels":
                    result = part_kernels(sizes, report, args.out)
                elif part == "decode":
                    result = part_decode(sizes, report, Path(tmp))
                else:
                    result = part_spec(sizes, report, Path(tmp))
            except Exception as exc:
                result = dict(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
                print(result["traceback"])
            result["seconds"] = time.perf_counter() - t0
            report[part] = result
            report["seconds"] = time.perf_counter() - start
            (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
            print(f"  ({part}: {result['seconds']:.0f} s)", flush=True)
    print(f"\nsummary ({name}, {report['seconds']:.0f} s):")
    for part in parts:
        r = report[part]
        status = "skipped" if "skipped" in r else ("ok" if r.get("ok", True) else "FAILED")
        print(f"  {part:10s} {status:8s} {r.get('error', '')[:150]}")
    print(f"wrote {args.out / 'gpu_check.json'}")
    try:
        (args.out / "gpu_check.md").write_text(render(args.out) + "\n")
        print(f"wrote {args.out / 'gpu_check.md'} and gpu_check.png")
    except Exception as exc:  # the figures are in the JSON already
        print(f"could not render the tables: {type(exc).__name__}: {exc}")
    return 0 if all(report[p].get("ok", True) for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())

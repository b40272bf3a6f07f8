"""benchmarks/gpu_check.py: on the CPU it says plainly that it checked nothing, and its --smoke
mode runs the same parts at toy sizes (kernels interpreted), so the script a lent GPU runs has
run before."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script does its real work")
def test_gpu_check_says_it_needs_cuda():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "needs CUDA" in proc.stdout and "nothing was checked" in proc.stdout


def test_gpu_check_builds_a_one_billion_parameter_config(load_benchmark):
    module = load_benchmark("gpu_check")
    import transformers

    config = transformers.LlamaConfig(**module.LLAMA_1B)
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    assert 1.0e9 <= n <= 1.5e9


def test_gpu_check_smoke_runs_every_part_on_the_cpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"env", "tests", "ops", "attention", "kernels", "decode", "spec", "sampling"} <= report.keys()
    assert report["sampling"]["ok"] and len(report["sampling"]["table"]) == 6
    assert all(c["ok"] for c in report["ops"]["checks"]) and len(report["ops"]["checks"]) == 8
    attention = report["attention"]
    assert attention["default"]["ok"] and len(attention["sweep"]) >= 15
    assert not [row for row in attention["sweep"] if "error" in row]
    assert report["decode"]["off"]["batch1_tokens_per_s"] > 0 and report["decode"]["transformers_batch1_tokens_per_s"] > 0
    # n-gram speculation on the same greedy prompts: the same tokens as plain decoding (fp32 would
    # guarantee it; bf16 on a toy model agrees here)
    assert report["spec"]["plain"]["tokens_per_s"] > 0 and report["spec"]["ngram_k4"]["draft_tokens"] > 0
    # the demo pair's speculation: every method at every case, the trained draft accepted, and
    # the coupled verifier's tokens those of plain decoding, greedy and seeded alike
    demo = report["spec_demo"]["table"]
    assert {(r["method"], r["batch"], r["temperature"]) for r in demo} == {
        (m, b, t) for m in ("plain, second engine", "draft k=4", "draft adaptive", "ngram adaptive")
        for b in (1, 2) for t in (0.0, 1.0)}
    assert all(r["identical"] and r["speedup_min"] > 0 for r in demo)
    greedy_draft = [r for r in demo if r["method"] == "draft k=4" and r["temperature"] == 0]
    assert all(r["acceptance"] > 0.5 for r in greedy_draft), greedy_draft
    # the prefill kernel's sweep: every setting computes the reference's result
    extend = report["extend"]["shapes"]
    assert extend and all(e["ok"] for r in extend.values() for e in r["sweep"]), extend
    assert all(r["default"]["ms"] > 0 and r["dense_ms"] > 0 for r in extend.values())
    assert "skipped" in report["serving"]  # its tests are the CPU suite's: CI runs them

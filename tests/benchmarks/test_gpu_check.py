"""benchmarks/gpu_check.py: the GPU check is untested on hardware (no GPU here); on the CPU it
must at least import and say plainly that it checked nothing."""
from __future__ import annotations

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

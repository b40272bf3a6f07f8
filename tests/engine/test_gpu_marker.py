"""The `gpu` marker skips outside tests/kernels too (tests/conftest.py), and only without CUDA."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_gpu_marked_tests_run_only_with_cuda():
    assert torch.cuda.is_available(), "a gpu-marked test ran on a machine without CUDA"

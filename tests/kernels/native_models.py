"""A tiny checkpoint's `ModelRunner` for the tests of the ops of `kernels/cpu/decoder.cpp` and
`draft_passes.cpp` (test_native_draft_passes.py, test_native_forward.py), and the skip of the tests
of the AVX2 variants (those and test_native_linear.py) on a CPU that cannot run them."""
from __future__ import annotations

import pytest
import torch


def native_runner(checkpoint, arch: str, seed: int, num_blocks: int, block_size: int):
    """A `ModelRunner` of a tiny checkpoint with the native attention and packed projections (what
    `kernels/cpu/decoder.h`'s layers run), on the torch reference ops otherwise; the test is skipped
    on a CPU whose build has no vector loops (the projections are then not packed)."""
    from pdserve.engine.model.config import load_model_config
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.kernels import TORCH_OPS, native

    assert native.load(), native.error()
    if not torch.ops.pdserve.linear_packed_available():
        pytest.skip("this CPU has neither AVX-512 nor AVX2: the projections are not packed, no native decoder ops")
    path = checkpoint(arch, seed=seed)
    return ModelRunner(load_model_config(path), path, TORCH_OPS, torch.float32, torch.device("cpu"),
                       num_blocks=num_blocks, block_size=block_size, native_attention=True, native_linear=True)


def require_avx2_fma() -> None:
    """Skips the calling test unless this CPU runs AVX2 with FMA (what the AVX2 variants need)."""
    line = next((ln for ln in open("/proc/cpuinfo").read().splitlines() if ln.startswith("flags")), "")
    if not {"avx2", "fma"} <= set(line.split(":", 1)[-1].split()):
        pytest.skip("this CPU cannot run AVX2 with FMA")

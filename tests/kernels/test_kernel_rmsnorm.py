"""rms_norm / fused_add_rms_norm (Triton) against their torch references."""
from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

# float32: only the sum-of-squares order differs (one tile tree vs torch's), a few ulp.
# half types: that ulp-level difference can flip one rounding of the normed value to the
# half dtype, i.e. one half-precision ulp (2^-7 relative for bf16, 2^-10 for fp16).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}

# x + residual is one rounded add, exact against torch, except that Triton's interpreter
# (3.9) converts fp32 -> bf16 by truncation instead of round-to-nearest-even: one bf16 ulp.
BF16_ULP = dict(atol=1e-6, rtol=2**-7) if os.environ.get("TRITON_INTERPRET") == "1" else dict(atol=0, rtol=0)
SUM_TOL = {torch.float32: dict(atol=0, rtol=0), torch.bfloat16: BF16_ULP}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (5, 96), (3, 1000)])
def test_rms_norm_matches_ref(dtype, num_tokens, hidden, device):
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype) * 3
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_ref(dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 200, generator=gen).to(device, dtype)
    residual = torch.randn(4, 200, generator=gen).to(device, dtype)
    weight = torch.randn(200, generator=gen).to(device, dtype)
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    normed_ref, summed_ref = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, summed_ref, **SUM_TOL[dtype])
    torch.testing.assert_close(normed, normed_ref, **TOL[dtype])


def test_rms_norm_mixed_dtypes_follow_promotion(device):
    # an fp32 weight on bf16 activations gives fp32 out, like the reference's `weight * x`
    x = torch.randn(2, 64).to(device, torch.bfloat16)
    weight = torch.rand(64).to(device)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=1e-2, rtol=1.6e-2)


def test_rms_norm_strided_rows(device):
    base = torch.randn(3, 128).to(device)
    x = base[:, :64]  # row stride 128, not contiguous
    weight = torch.ones(64).to(device)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **TOL[torch.float32])

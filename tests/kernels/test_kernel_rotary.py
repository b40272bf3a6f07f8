"""apply_rotary (Triton) against its torch reference."""
from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels.rotary import apply_rotary, apply_rotary_ref, build_rope_cache

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

# The kernel rounds each product and sum to the dtype exactly as the reference does op by op,
# so fp16 matches bit for bit; fp32 may differ by a contracted multiply-add (1 ulp). bf16 would
# be exact too, but Triton's interpreter (3.9) converts fp32 -> bf16 by truncation rather than
# round-to-nearest-even, which costs up to one bf16 ulp of each *product* (|x| < 4 for these
# randn inputs, bf16 ulp at 4 is 2^-5) and survives cancellation in the sum.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.float16: dict(atol=0, rtol=0),
    torch.bfloat16: dict(atol=2**-5, rtol=2**-6) if _INTERPRETED else dict(atol=0, rtol=0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 4, 1), (128, 8, 8), (64, 6, 2)])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_apply_rotary_matches_ref(dtype, head_dim, num_heads, num_kv_heads, scaling, device):
    gen = torch.Generator().manual_seed(head_dim * num_heads)
    cos, sin = build_rope_cache(head_dim, 300, 10000.0, scaling)
    positions = torch.tensor([0, 1, 17, 299, 5]).to(device)
    q = torch.randn(5, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(5, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    q_out, k_out = apply_rotary(q, k, positions, cos.to(device), sin.to(device))
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cos.to(device), sin.to(device))
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


def test_apply_rotary_position_zero_is_identity(device):
    cos, sin = build_rope_cache(64, 4, 10000.0)
    q = torch.randn(1, 2, 64).to(device)
    q_out, _ = apply_rotary(q, q[:, :1], torch.zeros(1, dtype=torch.long).to(device), cos.to(device), sin.to(device))
    torch.testing.assert_close(q_out, q)

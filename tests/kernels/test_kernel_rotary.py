"""apply_rotary (Triton) against its torch reference."""
from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels.rotary import apply_rotary, apply_rotary_ref, build_rope_cache, rope_at

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

# The kernel rounds each product and sum to the dtype as the reference does op by op, so
# interpreted, fp16 matches bit for bit; fp32 may differ by a contracted multiply-add (1 ulp).
# Interpreted bf16 is not exact: Triton's interpreter (3.9) converts fp32 -> bf16 by truncation
# rather than round-to-nearest-even, which costs up to one bf16 ulp of each *product* (|x| < 4
# for these randn inputs, bf16 ulp at 4 is 2^-5) and survives cancellation in the sum.
# Compiled (Triton 3.6 on an H200), the half types differ from the reference by one ulp of the
# result in about a tenth of the elements (at most 2^-6 in bf16 and 2^-9 in fp16 for these
# values, measured): the compiler narrows each product to the half type and fuses one product
# into the sum (`fma.rn.bf16` / `fma.rn.f16` in the PTX for sm_90), so that product is not
# rounded on its own: the more exact of the two. Compiled, one ulp at |x| < 8 is allowed.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.float16: dict(atol=0, rtol=0) if _INTERPRETED else dict(atol=2**-8, rtol=0),
    torch.bfloat16: dict(atol=2**-5, rtol=2**-6) if _INTERPRETED else dict(atol=2**-5, rtol=0),
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
    c, s = rope_at(cos.to(device), sin.to(device), positions, dtype)
    qk = torch.cat((q, k), 1)  # the model rotates q's and k's heads in one call
    torch.testing.assert_close(apply_rotary(qk, c, s), apply_rotary_ref(qk, c, s), **TOL[dtype])
    torch.testing.assert_close(apply_rotary(q, c, s), apply_rotary_ref(q, c, s), **TOL[dtype])
    # a strided view of the fused projection, as the model passes it
    qkv = torch.cat((q, k, k), 1)
    view = qkv[:, :num_heads + num_kv_heads]
    torch.testing.assert_close(apply_rotary(view, c, s), apply_rotary_ref(qk, c, s), **TOL[dtype])


def test_apply_rotary_position_zero_is_identity(device):
    cos, sin = build_rope_cache(64, 4, 10000.0)
    q = torch.randn(1, 2, 64).to(device)
    c, s = rope_at(cos.to(device), sin.to(device), torch.zeros(1, dtype=torch.long).to(device), q.dtype)
    for impl in (apply_rotary, apply_rotary_ref):
        torch.testing.assert_close(impl(q, c, s), q)


def test_apply_rotary_ref_is_transformers_rotation():
    """The reference against transformers' own `apply_rotary_pos_emb` and rotary module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=64)
    positions = torch.tensor([0, 3, 63, 17])
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, tokens, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    cos, sin = rope_at(*build_rope_cache(64, 64, config.rope_parameters["rope_theta"]), positions, torch.float32)
    ours = apply_rotary_ref(torch.cat((q, k), 1), cos, sin)
    torch.testing.assert_close(ours[:, :4], hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(ours[:, 4:], hf_k[0].transpose(0, 1), atol=0, rtol=0)

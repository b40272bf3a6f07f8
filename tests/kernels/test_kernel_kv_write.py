"""write_kv (Triton) against its torch reference."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_write import write_kv, write_kv_ref


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16)])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (4, 128, 16), (2, 64, 8)])
def test_write_kv_matches_ref(dtype, cache_dtype, num_kv_heads, head_dim, block_size, device):
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_blocks = 4
    k = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    # block boundaries on both sides, the very last slot, and two padding tokens
    last = num_blocks * block_size - 1
    slots = torch.tensor([0, block_size - 1, block_size, -1, last, -1], dtype=torch.long).to(device)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, cache_dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    # a copy (with at most one cast): exact, and untouched slots keep their old values
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


def test_write_kv_only_padding_changes_nothing(device):
    k_cache = torch.randn(2, 16, 1, 64).to(device)
    before = k_cache.clone()
    k = torch.randn(2, 1, 64).to(device)
    write_kv(k, k, k_cache, k_cache.clone(), torch.tensor([-1, -1]).to(device))
    assert torch.equal(k_cache, before)

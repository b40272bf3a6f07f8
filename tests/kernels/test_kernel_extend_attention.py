"""extend_attention: the reference against dense causal attention, the Triton kernel against
the reference, over ragged batches of query chunks."""
from __future__ import annotations

import pytest
import torch
from paged_kv_cases import dense_causal_attention, make_paged_kv

from pdserve.kernels.extend_attention import extend_attention, extend_attention_ref, extend_attention_with_settings

BLOCK_SIZE = 16
# (context_lens, chunk lengths). Each chunk is its sequence's last tokens.
CASES = {
    # whole-prompt prefill of 20 (two 16-row tiles), context 1, an empty chunk, spec verify k+1=5
    "ragged": ([20, 1, 9, 37], [20, 1, 0, 5]),
    # chunked prefill: a 70-token chunk after a 15-token prefix (64-row tiles), and a block
    # boundary +-1 for the rest
    "long_chunk": ([85, 17, 16], [70, 3, 16]),
    "single": ([1], [1]),
}

# Same accumulation argument as the decode tests: fp32 agrees to ~1e-6 relative; half outputs
# may differ by one ulp of the output dtype (the reference runs SDPA in the half dtype on CPU,
# so it is itself only good to about that).
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def _extend_inputs(context_lens, chunk_lens, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    k_dense, v_dense, k_cache, v_cache, tables = make_paged_kv(
        context_lens, num_kv_heads, head_dim, BLOCK_SIZE, dtype, device, seed)
    cu = torch.zeros(len(chunk_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(chunk_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q.to(device, dtype), k_dense, v_dense, k_cache, v_cache, tables, cu.to(device), lens


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 1)])
def test_extend_ref_matches_dense_attention(case, num_heads, num_kv_heads, device):
    context_lens, chunk_lens = CASES[case]
    q, k_dense, v_dense, k_cache, v_cache, tables, cu, lens = _extend_inputs(
        context_lens, chunk_lens, num_heads, num_kv_heads, 64, torch.float32, device)
    out = extend_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.125)
    for s, n in enumerate(chunk_lens):
        if n:
            expected = dense_causal_attention(q[cu[s] : cu[s + 1]], k_dense[s], v_dense[s], 0.125)
            torch.testing.assert_close(out[cu[s] : cu[s + 1]].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
def test_extend_kernel_matches_ref_fp32(case, num_heads, num_kv_heads, device):
    _check_kernel(*CASES[case], num_heads, num_kv_heads, 64, torch.float32, device)


# Triton's interpreter has no bf16 arithmetic, so interpreted bf16 runs keep fp32 products
# (`cache_dtype_dots_apply`): bf16 products are checked compiled, on a GPU
@pytest.mark.parametrize("dtype,cache_dtype_dots", [
    (torch.bfloat16, False), (torch.float16, False), (torch.float16, True),
    pytest.param(torch.bfloat16, True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", ["ragged", "long_chunk"])
def test_extend_kernel_matches_ref_half(dtype, cache_dtype_dots, case, device):
    # the reference's SDPA runs in the half dtype; compare both against the fp32 reference. In
    # the cache's dtype, q and the probabilities are rounded once more each: twice the tolerance
    q, _, _, k_cache, v_cache, tables, cu, lens = _extend_inputs(*CASES[case], 4, 2, 128, dtype, device)
    out = extend_attention_with_settings(q, k_cache, v_cache, tables, cu, lens, 128 ** -0.5,
                                         cache_dtype_dots=cache_dtype_dots)
    expected = extend_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, cu, lens, 128 ** -0.5)
    assert out.dtype == dtype
    tol = {k: v * (2 if cache_dtype_dots else 1) for k, v in TOL[dtype].items()}
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("block_m,block_n,num_warps", [(16, 16, 4), (64, 64, 4), (128, 32, 8), (128, 64, 8)])
def test_extend_kernel_launch_settings(block_m, block_n, num_warps, device):
    # the tiles and warps `benchmarks/gpu_check.py` sweeps compute the same thing
    q, _, _, k_cache, v_cache, tables, cu, lens = _extend_inputs(*CASES["long_chunk"], 8, 2, 64, torch.float16, device)
    want = extend_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, cu, lens, 0.125)
    out = extend_attention_with_settings(q, k_cache, v_cache, tables, cu, lens, 0.125, block_m=block_m,
                                         block_n=block_n, num_warps=num_warps)
    torch.testing.assert_close(out.float(), want, **{k: 2 * v for k, v in TOL[torch.float16].items()})


def test_extend_kernel_head_dim_128(device):
    _check_kernel(*CASES["ragged"], 4, 1, 128, torch.float32, device)


def _check_kernel(context_lens, chunk_lens, num_heads, num_kv_heads, head_dim, dtype, device):
    q, _, _, k_cache, v_cache, tables, cu, lens = _extend_inputs(
        context_lens, chunk_lens, num_heads, num_kv_heads, head_dim, dtype, device, seed=len(chunk_lens))
    scale = head_dim ** -0.5
    out = extend_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    torch.testing.assert_close(out, extend_attention_ref(q, k_cache, v_cache, tables, cu, lens, scale), **TOL[dtype])

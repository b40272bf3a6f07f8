"""gathered_attention (the CPU path for decode and short extends, one dense call per group)
against dense causal attention and against the per-sequence extend reference."""
from __future__ import annotations

import pytest
import torch
from paged_kv_cases import assert_matches_dense, make_paged_kv

from pdserve.kernels.extend_attention import extend_attention_ref
from pdserve.kernels.gathered_attention import gathered_attention, plan_gather

BLOCK_SIZE = 16
CASES = {  # (context_lens, query_lens)
    "decode-equal": ([33, 33], [1, 1]),  # no mask, no padding
    "decode-ragged": ([1, 16, 17, 40], [1, 1, 1, 1]),
    "verify-equal": ([20, 37, 9], [5, 5, 5]),  # speculative verification at fixed k
    "verify-ragged": ([20, 37, 9, 3], [5, 1, 3, 2]),  # adaptive k: padding and unpadding
    # sorted contexts far apart: several dense calls (runs of similar length), with padding
    "grouped": ([3, 5, 6, 8, 20, 26, 31, 33, 90, 95, 97, 99, 140], [1, 2, 1, 1, 3, 1, 1, 2, 1, 1, 4, 1, 1]),
}


def _inputs(context_lens, query_lens, num_heads, num_kv_heads, dtype, seed=0):
    k_dense, v_dense, k_cache, v_cache, tables = make_paged_kv(context_lens, num_kv_heads, 32, BLOCK_SIZE, dtype, "cpu", seed)
    q = torch.randn(sum(query_lens), num_heads, 32, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, k_dense, v_dense, k_cache, v_cache, tables


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_gathered_matches_dense_attention(case, num_heads, num_kv_heads):
    context_lens, query_lens = CASES[case]
    q, k_dense, v_dense, k_cache, v_cache, tables = _inputs(context_lens, query_lens, num_heads, num_kv_heads, torch.float32)
    plan = plan_gather(tables, context_lens, query_lens, BLOCK_SIZE)
    assert (plan.mask is None) == (case == "decode-equal")
    assert (plan.pad_index is None) == (case not in ("verify-ragged", "grouped"))
    assert (len(plan.groups) > 2) == (case == "grouped")
    assert [g[:2] for g in plan.groups] == list(zip([g[0] for g in plan.groups], [g[0] for g in plan.groups[1:]] +
                                                    [len(context_lens)]))  # contiguous runs covering all
    out = gathered_attention(q, k_cache, v_cache, plan, 0.2)
    assert_matches_dense(out, q, k_dense, v_dense, query_lens, 0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_matches_extend_reference(dtype):
    context_lens, query_lens = CASES["verify-ragged"]
    q, _, _, k_cache, v_cache, tables = _inputs(context_lens, query_lens, 8, 2, dtype, seed=3)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    expected = extend_attention_ref(q, k_cache, v_cache, tables, cu, torch.tensor(context_lens, dtype=torch.int32), 0.2)
    out = gathered_attention(q, k_cache, v_cache, plan_gather(tables, context_lens, query_lens, BLOCK_SIZE), 0.2)
    # the extend reference computes in the cache dtype, this path in float32
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, expected, **tol)


def test_runs_split_where_contexts_grow():
    from pdserve.kernels.gathered_attention import group_by_length

    assert group_by_length([40, 44, 51, 60, 130, 150, 170, 190, 390, 400]) == [(0, 4, 60), (4, 8, 190), (8, 10, 400)]
    assert group_by_length([10, 100, 1000]) == [(0, 3, 1000)]  # too few sequences to be worth a second call
    assert group_by_length([7]) == [(0, 1, 7)]

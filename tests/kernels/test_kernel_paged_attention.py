"""paged_decode_attention: the reference against dense attention, the Triton kernel (one pass
and split-K) against the reference."""
from __future__ import annotations

import pytest
import torch
from paged_kv_cases import dense_causal_attention, make_paged_kv

from pdserve.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_with_partitions,
)
from pdserve.kernels.paged_attention_all_heads import paged_decode_attention_all_heads
from pdserve.kernels.paged_launch import choose_block_n, choose_partition_size, choose_prefetch

BLOCK_SIZE = 16
# context 1, block boundary -1/0/+1, several blocks, and a batch of very different lengths
LENGTHS = [[1], [BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1], [3, 70, 1, 33]]

# The kernel accumulates in fp32 like the reference, in another order (online softmax over
# tiles): fp32 agrees to ~1e-6 relative. Half outputs are rounded once to the output dtype, so
# a one-ulp rounding flip is allowed: 2^-8 (bf16) / 2^-11 (fp16) relative, and an atol for
# outputs near zero (averages of unit-variance V values).
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
}


def _decode_inputs(lengths, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    k_dense, v_dense, k_cache, v_cache, tables = make_paged_kv(
        lengths, num_kv_heads, head_dim, BLOCK_SIZE, dtype, device, seed)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q.to(device, dtype), k_dense, v_dense, k_cache, v_cache, tables, context_lens


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
def test_decode_ref_matches_dense_attention(lengths, num_heads, num_kv_heads, device):
    q, k_dense, v_dense, k_cache, v_cache, tables, lens = _decode_inputs(
        lengths, num_heads, num_kv_heads, 64, torch.float32, device)
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    for s in range(len(lengths)):
        expected = dense_causal_attention(q[s : s + 1], k_dense[s], v_dense[s], 0.125)[0]
        torch.testing.assert_close(out[s].double(), expected, atol=1e-5, rtol=1e-5)  # fp32 vs fp64 math


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_kernel_matches_ref_fp32(lengths, num_heads, num_kv_heads, head_dim, device):
    _check_kernel(lengths, num_heads, num_kv_heads, head_dim, torch.float32, device, partition_size=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_kernel_matches_ref_half(dtype, device):
    _check_kernel(LENGTHS[2], 8, 2, 64, dtype, device, partition_size=0)


@pytest.mark.parametrize("lengths", [[1], [31, 32, 33, 64], [3, 100, 1, 65]])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 1, 128)])
def test_decode_split_k_matches_ref(lengths, num_heads, num_kv_heads, head_dim, device):
    # partitions of 32 tokens so short contexts still span several partitions, including
    # sequences that end exactly on, just before and just after a partition boundary
    _check_kernel(lengths, num_heads, num_kv_heads, head_dim, torch.float32, device, partition_size=32)


def test_decode_split_k_more_partitions_than_one_reduce_tile(device):
    # 19 partitions: the reduce kernel merges them over two tiles of 16 (its online rescale)
    _check_kernel([600, 17], 2, 1, 64, torch.float32, device, partition_size=32)


def test_decode_split_k_half(device):
    _check_kernel([5, 90], 8, 2, 64, torch.bfloat16, device, partition_size=32)


@pytest.mark.parametrize("block_n,partition_size,heads_first", [(16, 0, False), (16, 32, True), (64, 0, True),
                                                                  (64, 64, False), (128, 128, True)])
def test_decode_kernel_tile_sizes(block_n, partition_size, heads_first, device):
    # the tile sizes, grid orders and launch settings `benchmarks/gpu_check.py` sweeps compute the same thing
    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs([3, 100, 1, 65], 8, 2, 64, torch.float32, device, seed=5)
    out = paged_decode_attention_with_partitions(q, k_cache, v_cache, tables, lens, 0.125, partition_size,
                                                 block_n=block_n, num_warps=2, num_stages=2, heads_first=heads_first)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125),
                               **TOL[torch.float32])


@pytest.mark.parametrize("block_n,partition_size", [(16, 0), (16, 32), (32, 64), (64, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_prefetch(block_n, partition_size, dtype, device):
    # the next tile loaded while this one is computed: lengths ending inside the first, second and
    # a later tile, a context of one token, and partitions that end before the tiles run out
    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs([1, 15, 17, 33, 100, 65], 8, 2, 64, dtype, device,
                                                             seed=13)
    out = paged_decode_attention_with_partitions(q, k_cache, v_cache, tables, lens, 0.125, partition_size,
                                                 block_n=block_n, prefetch=True,
                                                 cache_dtype_dots=dtype == torch.float16)
    tol = {k: (2 if dtype == torch.float16 else 1) * v for k, v in TOL[dtype].items()}
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125), **tol)


@pytest.mark.parametrize("partition_size,block_n,heads_first", [(16, 16, False), (32, 16, True), (64, 32, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_fused_reduce(partition_size, block_n, heads_first, dtype, device):
    # the last partition of each (sequence, KV head) merges them all: one partition, several, and
    # sequences shorter than one; twice, so the counters left behind (at zero) serve the next call
    from pdserve.kernels.paged_attention import split_counters

    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs([1, 15, 17, 33, 100, 65], 8, 2, 64, dtype, device,
                                                             seed=17)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    tol = {k: (2 if dtype == torch.float16 else 1) * v for k, v in TOL[dtype].items()}
    for _ in range(2):
        out = paged_decode_attention_with_partitions(q, k_cache, v_cache, tables, lens, 0.125, partition_size,
                                                     block_n=block_n, heads_first=heads_first, fused_reduce=True,
                                                     cache_dtype_dots=dtype == torch.float16)
        torch.testing.assert_close(out, want, **tol)
        assert not split_counters(k_cache.device, 12).any(), "every counter is back at zero"


# Triton's interpreter computes bf16 dots wrongly (it has no bf16 arithmetic); fp16 runs everywhere
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("partition_size", [0, 32])
def test_decode_kernel_with_dots_in_the_cache_dtype(dtype, partition_size, device):
    # q and the probabilities rounded to the 16-bit dtype: one more rounding of each, so twice the tolerance
    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs([5, 90, 33], 8, 2, 64, dtype, device, seed=7)
    out = paged_decode_attention_with_partitions(q, k_cache, v_cache, tables, lens, 0.125, partition_size,
                                                 cache_dtype_dots=True)
    tol = {k: 2 * v for k, v in TOL[dtype].items()}
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125), **tol)


def test_launcher_dispatch(device):
    # default launcher on a case the heuristic sends to split-K: few sequences, long tables
    assert choose_partition_size(1, 1, 4096, torch.device("cpu")) > 0
    assert choose_partition_size(512, 8, 4096, torch.device("cpu")) == 0
    assert choose_partition_size(1, 1, 256, torch.device("cpu")) == 0
    # split until about three programs per multiprocessor (132 on an H200), by powers of two
    assert choose_partition_size(32, 8, 2048, torch.device("cpu")) == 1024  # 256 programs -> 512
    assert choose_partition_size(64, 8, 2048, torch.device("cpu")) == 0  # 512 programs already
    assert choose_partition_size(8, 8, 4096, torch.device("cpu")) == 512
    assert choose_partition_size(1, 8, 4096, torch.device("cpu")) == 128  # never below one tile
    # above head_dim 64 a program per multiprocessor is enough
    assert choose_partition_size(32, 8, 2048, torch.device("cpu"), head_dim=128) == 0
    assert choose_partition_size(1, 8, 4096, torch.device("cpu"), head_dim=128) == 128
    assert choose_block_n(64) == 128 and choose_block_n(128) == 64
    # the next tile prefetched only in one pass over fewer than three programs per multiprocessor
    assert choose_prefetch(32, 8, 0, torch.device("cpu"))  # 256 programs
    assert not choose_prefetch(64, 8, 0, torch.device("cpu"))  # 512
    assert not choose_prefetch(8, 8, 512, torch.device("cpu"))  # split-K
    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs([40, 7], 4, 2, 64, torch.float32, device)
    torch.testing.assert_close(paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1),
                               paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.1), **TOL[torch.float32])


@pytest.mark.parametrize("max_batch", [1, 20, 48, 100, 512])
def test_eager_steps_split_as_their_cuda_graph_bucket(max_batch):
    # a step of n decodes runs eagerly with n rows or replays its bucket's graph with more: both
    # must choose the same partition size, or the two compute different bits
    from pdserve.engine.cuda_graphs import bucket_sizes

    buckets = bucket_sizes(max_batch)
    for n in range(1, max_batch + 1):
        bucket = next(b for b in buckets if b >= n)
        for kv_heads, context, head_dim in ((8, 4096, 64), (1, 2048, 128), (4, 8192, 64)):
            assert (choose_partition_size(n, kv_heads, context, torch.device("cpu"), head_dim)
                    == choose_partition_size(bucket, kv_heads, context, torch.device("cpu"), head_dim)), (n, bucket)


def _check_kernel(lengths, num_heads, num_kv_heads, head_dim, dtype, device, partition_size):
    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs(
        lengths, num_heads, num_kv_heads, head_dim, dtype, device, seed=sum(lengths))
    scale = head_dim ** -0.5
    out = paged_decode_attention_with_partitions(q, k_cache, v_cache, tables, lens, scale, partition_size)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("lengths", [[1], [31, 32, 33, 64], [3, 100, 1, 65]])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (12, 3, 32), (4, 4, 128)])
@pytest.mark.parametrize("partition_size,block_n", [(0, 16), (32, 16), (64, 32)])
def test_all_heads_kernel_matches_ref(lengths, num_heads, num_kv_heads, head_dim, partition_size, block_n, device):
    # one program over every KV head of a sequence (3 KV heads: a padded head axis)
    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs(lengths, num_heads, num_kv_heads, head_dim,
                                                             torch.float32, device, seed=sum(lengths) + 3)
    out = paged_decode_attention_all_heads(q, k_cache, v_cache, tables, lens, 0.1, partition_size, block_n=block_n)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.1),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_all_heads_kernel_half(dtype, device):
    # q and the probabilities rounded to the cache's dtype for the products: twice the tolerance
    q, _, _, k_cache, v_cache, tables, lens = _decode_inputs([5, 90, 33], 32, 8, 64, dtype, device, seed=11)
    out = paged_decode_attention_all_heads(q, k_cache, v_cache, tables, lens, 0.125, 32, block_n=16)
    tol = {k: 2 * v for k, v in TOL[dtype].items()}
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125), **tol)

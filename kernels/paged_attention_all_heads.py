"""Paged decode attention with one program per (sequence, partition) over every KV head.

`paged_attention.py`'s kernel gives each (sequence, KV head) its own program, which reads one
head's rows of each cache block: head_dim values (128 bytes at head_dim 64 in bf16) every
num_kv_heads * head_dim. This one reads a token's K or V for all KV heads at once, a whole row of
the block (num_kv_heads * head_dim values, contiguous), and computes every head's scores with
one batched (3-D) product: the same arithmetic in longer, contiguous reads, and a grid of
num_seqs x partitions. Same inputs, outputs and split-K reduce as `paged_decode_attention`.

Not the default: on the H200 (`benchmarks/gpu_check.py`, BENCHMARKS.md) its best of 16
settings ran batch 32 at context 2048 at 2.37 TB/s in each of two runs, against 2.43 for the
per-head kernel's default (128-token tiles, one pass), so longer contiguous reads were not what
that kernel lacked. It stays for the sweep, where another GPU may rank them otherwise.
"""
from __future__ import annotations

import torch

from pdserve.kernels._triton import tl, triton
from pdserve.kernels.paged_attention import DecodeLaunch, dot_precision, partition_bounds


@triton.jit
def paged_decode_all_heads_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    scale, head_dim, num_kv_heads, num_queries_per_kv, max_partitions,
    q_seq_stride, q_head_stride, out_seq_stride, out_head_stride, block_table_stride,
    cache_block_stride, cache_offset_stride, cache_head_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PARTITION_SIZE: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start, end = partition_bounds(tl.load(context_lens_ptr + seq), part, PARTITION_SIZE, IS_SPLIT)
    if start < end:  # partitions past this sequence's end do nothing; the reduce skips them
        offs_h = tl.arange(0, BLOCK_H)  # KV heads
        offs_g = tl.arange(0, BLOCK_G)  # query heads of a KV head
        offs_d = tl.arange(0, BLOCK_D)
        heads = offs_h[:, None] * num_queries_per_kv + offs_g[None, :]  # [H, G] query head numbers
        head_ok = (offs_h[:, None] < num_kv_heads) & (offs_g[None, :] < num_queries_per_kv)
        io_mask = head_ok[:, :, None] & (offs_d[None, None, :] < head_dim)
        q = tl.load(q_ptr + seq * q_seq_stride + heads[:, :, None] * q_head_stride + offs_d[None, None, :],
                    mask=io_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)  # [H, G, D]
        block_table_ptr = block_tables_ptr + seq * block_table_stride
        head_cols = offs_h[:, None, None] * cache_head_stride + offs_d[None, None, :]  # [H, 1, D]
        col_ok = (offs_h[:, None, None] < num_kv_heads) & (offs_d[None, None, :] < head_dim)
        m_i = tl.full([BLOCK_H, BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H, BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            is_valid = offs_n < end
            block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=is_valid, other=0).to(tl.int64)
            rows = block_ids * cache_block_stride + (offs_n % BLOCK_SIZE) * cache_offset_stride  # [N]
            offsets = rows[None, :, None] + head_cols  # [H, N, D]
            mask = col_ok & is_valid[None, :, None]
            k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
            scores = tl.dot(q, tl.permute(k, (0, 2, 1)), input_precision=DOT_PRECISION) * scale  # [H, G, N]
            scores = tl.where(is_valid[None, None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 2))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, :, None])
            l_i = l_i * alpha + tl.sum(p, 2)
            v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
            acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # [H, G, D]
            m_i = m_new
        out = acc / l_i[:, :, None]
        if IS_SPLIT:
            # partial buffers as the per-head kernel writes them: [num_seqs, num_heads, max_partitions, D]
            slot = (seq * (num_kv_heads * num_queries_per_kv) + heads) * max_partitions + part  # [H, G]
            tl.store(partial_out_ptr + slot[:, :, None] * BLOCK_D + offs_d[None, None, :], out, mask=io_mask)
            tl.store(partial_lse_ptr + slot, m_i + tl.log(l_i), mask=head_ok)
        else:
            tl.store(out_ptr + seq * out_seq_stride + heads[:, :, None] * out_head_stride + offs_d[None, None, :],
                     out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_decode_attention_all_heads(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
    partition_size: int,  # 0: one pass; else split-K with partitions of this many tokens
    *,
    block_n: int = 32,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """`paged_decode_attention_ref`, every KV head of a sequence in one program (q is rounded to
    the cache's dtype for the products; with a 16-bit cache so are the probabilities)."""
    run = DecodeLaunch(q, k_cache, v_cache, block_tables, context_lens, partition_size, block_n, num_warps, num_stages)
    if run.num_seqs == 0:
        return run.out
    paged_decode_all_heads_kernel[(run.num_seqs, run.max_partitions)](
        run.out, run.partial_out, run.partial_lse, q, k_cache, v_cache, block_tables, context_lens,
        scale, run.head_dim, run.num_kv_heads, run.group, run.max_partitions,
        q.stride(0), q.stride(1), run.out.stride(0), run.out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=run.block_size, BLOCK_H=triton.next_power_of_2(run.num_kv_heads),
        BLOCK_G=max(16, triton.next_power_of_2(run.group)), BLOCK_N=block_n, BLOCK_D=run.block_d,
        PARTITION_SIZE=max(partition_size, 1), IS_SPLIT=run.is_split,
        DOT_PRECISION=dot_precision(q.dtype, k_cache.dtype), **run.settings,
    )
    return run.finish()

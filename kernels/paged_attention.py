"""Paged decode attention: one query token per sequence over its paged K/V.

Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads).
Block tables are padded with any value past a sequence's blocks; entries beyond
ceil(context_len / block_size) are never read.
"""
from __future__ import annotations

import os

import torch

from pdserve.kernels._triton import tl, triton
from pdserve.kernels.gathered_attention import gathered_attention, plan_gather
from pdserve.kernels.paged_launch import choose_block_n, choose_partition_size, choose_prefetch


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [..., max_blocks] int
    length: int,
) -> torch.Tensor:
    """The first `length` cached tokens of each row: [..., length, num_kv_heads, head_dim].

    Blocks are copied whole as rows of a [num_blocks, block_size * num_kv_heads * head_dim]
    view (`index_select`), several times faster on CPU than advanced indexing of the 4-D cache."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    ids = block_table[..., :num_blocks].long().clamp(min=0)
    rows = cache.view(cache.shape[0], -1).index_select(0, ids.reshape(-1))
    kv = rows.view(*ids.shape[:-1], num_blocks * block_size, *cache.shape[2:])
    return kv[..., :length, :, :]


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Every sequence's context gathered to the longest one, padding masked out, one dense
    attention call; math in float32 whatever the cache dtype. The engine on the CPU makes the
    plan once per step and calls `gathered_attention` in every layer."""
    lens = context_lens.tolist()
    plan = plan_gather(block_tables, lens, [1] * len(lens), k_cache.shape[1])
    return gathered_attention(q, k_cache, v_cache, plan, scale)


# --- Triton ------------------------------------------------------------------------------
#
# One program per (sequence, KV head[, partition]) holds the whole GQA group of query heads as
# the rows of one tile, so each K/V token is read once for all heads that share it:
#
#     q tile  [BLOCK_G, D]   rows = query heads kv_head*G .. kv_head*G+G-1 (padded to >= 16)
#     K tile  [BLOCK_N, D]   BLOCK_N consecutive tokens, gathered page by page via block_table
#
# Split-K (flash-decoding) cuts the context into partitions of PARTITION_SIZE tokens; each
# writes a normalised partial output and its log-sum-exp, and either the last partition of each
# (sequence, KV head) to finish merges them (the fused reduce, the default) or a reduce kernel
# does. What made the default fast on the H200, each measured there: enough programs per
# multiprocessor (`choose_partition_size`), 16-bit products, the fused reduce (39.3 against
# 41.1 us at batch 32, context 2048), and in one pass the next tile prefetched by hand
# (`choose_prefetch`).

@triton.jit
def load_kv_tile(
    cache_ptr, block_table_ptr, kv_head, offs_n, is_valid, offs_d, head_dim,
    cache_block_stride, cache_offset_stride, cache_head_stride,
    BLOCK_SIZE: tl.constexpr, AS_F32: tl.constexpr,
):
    """K or V of tokens `offs_n` [BLOCK_N] of one sequence, [BLOCK_N, BLOCK_D]: float32, or the
    cache's own dtype when not AS_F32."""
    block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=is_valid, other=0)
    return load_rows(cache_ptr, block_ids, kv_head, offs_n, is_valid, offs_d, head_dim,
                     cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, AS_F32)


@triton.jit
def load_rows(
    cache_ptr, block_ids, kv_head, offs_n, is_valid, offs_d, head_dim,
    cache_block_stride, cache_offset_stride, cache_head_stride,
    BLOCK_SIZE: tl.constexpr, AS_F32: tl.constexpr,
):
    """`load_kv_tile` with each token's cache block already looked up: [BLOCK_N] block_ids."""
    rows = (block_ids.to(tl.int64) * cache_block_stride + (offs_n % BLOCK_SIZE) * cache_offset_stride
            + kv_head * cache_head_stride)
    mask = is_valid[:, None] & (offs_d[None, :] < head_dim)
    tile = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if AS_F32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def partition_bounds(context_len, part, PARTITION_SIZE: tl.constexpr, IS_SPLIT: tl.constexpr):
    """Tokens [start, end) of a sequence's context that partition `part` attends (split-K), or
    all of them; start >= end for partitions past the sequence's end."""
    if IS_SPLIT:
        start = part * PARTITION_SIZE
        end = tl.minimum(start + PARTITION_SIZE, context_len)
    else:
        start = 0
        end = context_len
    return start, end


@triton.jit
def merge_partitions(out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, offs_d, head_mask, row_mask,
                     num_parts, num_heads, max_partitions, out_seq_stride, out_head_stride,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fused reduce: rows `heads` of one sequence, merged over their num_parts partitions
    (loads through the L2: other programs wrote them)."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for p in range(0, num_parts):
        slot = (seq * num_heads + heads) * max_partitions + p
        lse = tl.load(partial_lse_ptr + slot, mask=head_mask, other=0.0, cache_modifier=".cg")
        o = tl.load(partial_out_ptr + slot[:, None] * BLOCK_D + offs_d[None, :], mask=row_mask, other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        denom = denom * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + offs_d[None, :],
             (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def paged_decode_attention_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    scale, head_dim, num_heads, num_queries_per_kv, max_partitions,
    q_seq_stride, q_head_stride, out_seq_stride, out_head_stride, block_table_stride,
    cache_block_stride, cache_offset_stride, cache_head_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CACHE_DTYPE_DOTS: tl.constexpr = False, KV_AS_F32: tl.constexpr = True, HEADS_FIRST: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, FUSED_REDUCE: tl.constexpr = False,
):
    # CACHE_DTYPE_DOTS (and not KV_AS_F32): both products in the cache's 16-bit dtype (q and the
    # probabilities rounded to it), accumulating in float32; otherwise K and V are widened first
    # HEADS_FIRST: the grid is (KV head, sequence, partition), so the programs that run side by
    # side read neighbouring rows of the same cache blocks; else (sequence, KV head, partition)
    # PREFETCH: software pipelining by hand: while a tile is computed, the next tile's K and V
    # and the block ids of the one after are already loading (Triton's own pipelining does not
    # take these gathered loads: its shared memory stays one tile deep at any num_stages)
    # FUSED_REDUCE (split-K): no reduce kernel; each program counts itself done on its (sequence,
    # KV head)'s counter, and the last of its partitions merges them all and resets the counter
    if HEADS_FIRST:
        seq = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(0)
        num_kv_heads = tl.num_programs(0)
    else:
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start, end = partition_bounds(context_len, part, PARTITION_SIZE, IS_SPLIT)
    if start < end:  # partitions past this sequence's end do nothing; the reduce skips them
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * num_queries_per_kv + offs_g
        row_mask = (offs_g[:, None] < num_queries_per_kv) & (offs_d[None, :] < head_dim)
        q = tl.load(q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + offs_d[None, :],
                    mask=row_mask, other=0.0)
        if CACHE_DTYPE_DOTS:
            q = q.to(k_cache_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)
        block_table_ptr = block_tables_ptr + seq * block_table_stride
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if PREFETCH:  # tile 0's K and V in flight, and tile 1's block ids
            offs_n = start + tl.arange(0, BLOCK_N)
            ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < end, other=0)
            k_next = load_rows(k_cache_ptr, ids, kv_head, offs_n, offs_n < end, offs_d, head_dim,
                               cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
            v_next = load_rows(v_cache_ptr, ids, kv_head, offs_n, offs_n < end, offs_d, head_dim,
                               cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
            offs_n += BLOCK_N
            ids_next = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < end, other=0)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            is_valid = offs_n < end
            if PREFETCH:  # this tile's K and V were loaded an iteration ago; start the next tile's
                k, v = k_next, v_next
                offs_1, offs_2 = offs_n + BLOCK_N, offs_n + 2 * BLOCK_N
                k_next = load_rows(k_cache_ptr, ids_next, kv_head, offs_1, offs_1 < end, offs_d, head_dim,
                                   cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
                v_next = load_rows(v_cache_ptr, ids_next, kv_head, offs_1, offs_1 < end, offs_d, head_dim,
                                   cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
                ids_next = tl.load(block_table_ptr + offs_2 // BLOCK_SIZE, mask=offs_2 < end, other=0)
            else:
                k = load_kv_tile(k_cache_ptr, block_table_ptr, kv_head, offs_n, is_valid, offs_d, head_dim,
                                 cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            scores = tl.where(is_valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if not PREFETCH:
                v = load_kv_tile(v_cache_ptr, block_table_ptr, kv_head, offs_n, is_valid, offs_d, head_dim,
                                 cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        if IS_SPLIT:
            # partial buffers: out [num_seqs, num_heads, max_partitions, D], lse [.., max_partitions]
            slot = (seq * num_heads + heads) * max_partitions + part
            tl.store(partial_out_ptr + slot[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_mask)
            tl.store(partial_lse_ptr + slot, m_i + tl.log(l_i), mask=offs_g < num_queries_per_kv)
            if FUSED_REDUCE:
                num_parts = tl.cdiv(context_len, PARTITION_SIZE)
                counter = counters_ptr + seq * num_kv_heads + kv_head
                # acq_rel: this program's partials are visible before its count; the last sees all
                if tl.atomic_add(counter, 1, sem="acq_rel") == num_parts - 1:
                    tl.store(counter, 0)
                    merge_partitions(out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, offs_d,
                                     offs_g < num_queries_per_kv, row_mask,
                                     num_parts, num_heads, max_partitions, out_seq_stride, out_head_stride,
                                     BLOCK_G, BLOCK_D)
        else:
            tl.store(out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def paged_decode_attention_reduce_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, context_lens_ptr,
    head_dim, num_heads, num_queries_per_kv, max_partitions, out_seq_stride, out_head_stride,
    PARTITION_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # split-K without the fused reduce: one program per (sequence, KV head) merges its query
    # heads' partitions, as the fused reduce's last partition does
    seq = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.program_id(1) * num_queries_per_kv + offs_g
    head_mask = offs_g < num_queries_per_kv
    merge_partitions(out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, offs_d, head_mask,
                     head_mask[:, None] & (offs_d[None, :] < head_dim),
                     tl.cdiv(tl.load(context_lens_ptr + seq), PARTITION_SIZE), num_heads, max_partitions,
                     out_seq_stride, out_head_stride, BLOCK_G, BLOCK_D)


def cache_dtype_dots_apply(asked: bool, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a kernel asked for 16-bit products gets them: on a 16-bit cache with q of its
    dtype, and for bf16 only compiled (Triton's interpreter has no bf16 arithmetic: its bf16
    products come out as garbage, so interpreted bf16 runs widen to fp32 as before)."""
    if not asked or q_dtype != cache_dtype or cache_dtype not in (torch.float16, torch.bfloat16):
        return False
    return cache_dtype == torch.float16 or os.environ.get("TRITON_INTERPRET") != "1"


def dot_precision(*dtypes: torch.dtype) -> str:
    # 16-bit values are exact in tf32, so tensor cores lose nothing on them; fp32 inputs get ieee
    # to match the fp32 reference.
    return "tf32" if all(d in (torch.float16, torch.bfloat16) for d in dtypes) else "ieee"


def check_paged_inputs(q, k_cache, v_cache, block_tables, num_rows: int) -> None:
    """Shape/stride/dtype invariants shared by the paged attention launchers."""
    assert q.dim() == 3 and q.stride(2) == 1, f"q must be [tokens, heads, head_dim] with contiguous head_dim, got {tuple(q.shape)} {q.stride()}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), \
        f"k_cache/v_cache must be equal [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
    assert k_cache.stride(3) == 1, f"cache head_dim must be contiguous, got strides {k_cache.stride()}"
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_rows and block_tables.stride(1) == 1, \
        f"block_tables must be [{num_rows}, max_blocks] with contiguous rows, got {tuple(block_tables.shape)}"
    assert not block_tables.dtype.is_floating_point, f"block_tables must be integers, got {block_tables.dtype}"


class DecodeLaunch:
    """What both decode kernels' launchers share: the checks, the output, split-K's partial
    buffers, the launch settings, and the reduce that merges the partitions."""

    def __init__(self, q, k_cache, v_cache, block_tables, context_lens, partition_size: int, block_n: int,
                 num_warps: int | None, num_stages: int | None):
        self.num_seqs, self.num_heads, self.head_dim = q.shape
        check_paged_inputs(q, k_cache, v_cache, block_tables, self.num_seqs)
        assert context_lens.shape == (self.num_seqs,), \
            f"context_lens must be [{self.num_seqs}], got {tuple(context_lens.shape)}"
        assert partition_size == 0 or partition_size % block_n == 0, f"partition_size must be a multiple of {block_n}"
        self.block_size, self.num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        self.group = self.num_heads // self.num_kv_heads
        self.partition_size, self.is_split = partition_size, partition_size > 0
        self.block_d = max(16, triton.next_power_of_2(self.head_dim))
        self.max_partitions = (triton.cdiv(block_tables.shape[1] * self.block_size, partition_size)
                               if partition_size else 1)
        self.settings = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
        self.out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.partial_out = self.partial_lse = self.out  # unused in one pass
        if self.is_split and self.num_seqs:
            shape = (self.num_seqs, self.num_heads, self.max_partitions)
            self.partial_out = torch.empty(*shape, self.block_d, dtype=torch.float32, device=q.device)
            self.partial_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        self.context_lens = context_lens

    def finish(self, merged: bool = False) -> torch.Tensor:
        """Merge the partitions (split-K) unless the kernel has (`merged`), and return the output."""
        if self.is_split and self.num_seqs and not merged:
            paged_decode_attention_reduce_kernel[(self.num_seqs, self.num_kv_heads)](
                self.out, self.partial_out, self.partial_lse, self.context_lens, self.head_dim, self.num_heads,
                self.group, self.max_partitions, self.out.stride(0), self.out.stride(1),
                PARTITION_SIZE=self.partition_size, BLOCK_G=triton.next_power_of_2(self.group), BLOCK_D=self.block_d,
            )
        return self.out


def paged_decode_attention_with_partitions(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
    partition_size: int,  # 0: one pass; else split-K with partitions of this many tokens
    *,
    block_n: int = 32,  # tokens per tile; the rest are launch settings (None: Triton's defaults),
    num_warps: int | None = None,  # exposed for `benchmarks/gpu_check.py`'s sweep
    num_stages: int | None = None,
    cache_dtype_dots: bool = False,  # 16-bit caches only: see the kernel
    heads_first: bool = False,  # the grid's order: see the kernel
    prefetch: bool = False,  # the next tile's loads issued before this tile's products: see the kernel
    fused_reduce: bool = False,  # split-K: the last partition merges, no reduce kernel: see the kernel
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    run = DecodeLaunch(q, k_cache, v_cache, block_tables, context_lens, partition_size, block_n, num_warps, num_stages)
    if run.num_seqs == 0:
        return run.out
    dots_16 = cache_dtype_dots_apply(cache_dtype_dots, q.dtype, k_cache.dtype)
    grid = ((run.num_kv_heads, run.num_seqs, run.max_partitions) if heads_first
            else (run.num_seqs, run.num_kv_heads, run.max_partitions))
    counters = split_counters(q.device, run.num_seqs * run.num_kv_heads) if run.is_split and fused_reduce else None
    paged_decode_attention_kernel[grid](
        run.out, run.partial_out, run.partial_lse, run.out if counters is None else counters,
        q, k_cache, v_cache, block_tables, context_lens,
        scale, run.head_dim, run.num_heads, run.group, run.max_partitions,
        q.stride(0), q.stride(1), run.out.stride(0), run.out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=run.block_size, BLOCK_G=max(16, triton.next_power_of_2(run.group)), BLOCK_N=block_n,
        BLOCK_D=run.block_d, PARTITION_SIZE=max(partition_size, 1), IS_SPLIT=run.is_split,
        DOT_PRECISION=dot_precision(q.dtype, k_cache.dtype),
        CACHE_DTYPE_DOTS=dots_16, KV_AS_F32=not dots_16, HEADS_FIRST=heads_first, PREFETCH=prefetch,
        FUSED_REDUCE=counters is not None, **run.settings,
    )
    return run.finish(merged=counters is not None)


_COUNTERS: dict = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The fused reduce's counters, one per (sequence, KV head): zeros, kept per device and left
    at zero by every launch (the last partition resets its counter), so one allocation serves
    every call and every CUDA graph replay. None (the reduce kernel then runs) when there are too
    few and a CUDA graph is being captured, which must not allocate what outlives it; the engine
    runs every bucket eagerly before capturing it, so that does not happen there. Launches that
    share a device must be ordered (one stream), as an engine's are."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        have = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return have


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Triton `paged_decode_attention_ref`; picks one pass or split-K, the tile and the prefetch
    without a host sync; split-K merges in the kernel (the fused reduce). On 16-bit caches both
    products take 16-bit operands (q and the probabilities rounded once more, as FlashAttention
    rounds its probabilities): 8% faster on the H200 at batch 32, context 2048 (41.5 against
    45.3 us). There, all of it: 38.8-39.0 us in five timings, 72% of the datasheet's 4.8 TB/s
    (`benchmarks/gpu_check.py`, BENCHMARKS.md)."""
    max_context = block_tables.shape[1] * k_cache.shape[1]
    partition_size = choose_partition_size(q.shape[0], k_cache.shape[2], max_context, q.device, q.shape[2])
    return paged_decode_attention_with_partitions(
        q, k_cache, v_cache, block_tables, context_lens, scale, partition_size, block_n=choose_block_n(q.shape[2]),
        cache_dtype_dots=True, prefetch=choose_prefetch(q.shape[0], k_cache.shape[2], partition_size, q.device),
        fused_reduce=True, heads_first=partition_size > 0)

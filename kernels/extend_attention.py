"""Paged prefill ("extend") attention over a ragged batch of query chunks.

Sequence s contributes q[cu_seqlens_q[s]:cu_seqlens_q[s+1]], the *last* n_s tokens of its
context of context_lens[s] tokens, whose K/V (these n_s tokens included) are already in the
paged cache. Query i of the chunk sits at position context_len - n_s + i and attends causally
to cache positions 0..that position. Chunked prefill (n_s = chunk) and speculative verification
(n_s = k + 1) both run through this op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels._triton import tl, triton
from pdserve.kernels.kv_write import write_kv_ref
from pdserve.kernels.paged_attention import (cache_dtype_dots_apply, check_paged_inputs, dot_precision, gather_kv,
                                             load_kv_tile, paged_decode_attention_ref)


def extend_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for s, length in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[s], length).to(q.dtype)  # [L, Hkv, D]
        v = gather_kv(v_cache, block_tables[s], length).to(q.dtype)
        if end - start == length:  # no cached prefix: plain causal, torch's fast path
            mask, causal = None, True
        else:
            q_pos = torch.arange(length - (end - start), length, device=q.device)
            mask, causal = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None], False  # [n, L]
        # 4-D ([1, heads, tokens, dim]): on the CPU only then does torch pick its fused (flash)
        # kernel; 3-D inputs take the unfused math path, 3x slower at 166 tokens, 12x at 2048
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


# --- Triton ------------------------------------------------------------------------------
#
# Programs are (query tile, query head). Sequence s owns tiles tile_cu[s] .. tile_cu[s+1]-1
# of BLOCK_M query tokens each; a program finds its sequence by binary search in tile_cu, so
# the grid is sized from shapes alone (num_tokens / BLOCK_M + num_seqs tiles at most) and the
# launcher never waits on the GPU for the chunk lengths. Spare programs exit at once.
#
#     seq 0: q tokens [0, 20)  -> tiles 0, 1       tile_cu = [0, 2, 3, 3, 5]
#     seq 1: q tokens [20, 25) -> tile 2
#     seq 2: (empty)           -> no tile
#     seq 3: q tokens [25, 57) -> tiles 3, 4


@triton.jit
def extend_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, tile_cu_ptr,
    scale, num_seqs, head_dim, num_queries_per_kv,
    q_token_stride, q_head_stride, out_token_stride, out_head_stride, block_table_stride,
    cache_block_stride, cache_offset_stride, cache_head_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CACHE_DTYPE_DOTS: tl.constexpr, KV_AS_F32: tl.constexpr,
):
    """CACHE_DTYPE_DOTS (16-bit caches): q and the probabilities are rounded to the cache's dtype
    and both products run on it, accumulating in fp32, as FlashAttention does; else q, K and V
    are widened to fp32 and the products run in tf32 (16-bit inputs) or full fp32."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    if pid < tl.load(tile_cu_ptr + num_seqs):
        # the last sequence whose first tile is <= pid (empty sequences share their start with
        # the next one, so "last" skips them)
        lo = tl.zeros([], tl.int32)  # tensors, not Python ints: num_seqs == 1 arrives as a constexpr
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            go_right = tl.load(tile_cu_ptr + mid) <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        seq = lo.to(tl.int64)
        tile = pid - tl.load(tile_cu_ptr + seq)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        context_len = tl.load(context_lens_ptr + seq)
        kv_head = head // num_queries_per_kv

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_pos = context_len - q_len + offs_m  # absolute positions of this tile's queries
        tokens = (q_start + offs_m).to(tl.int64)
        io_mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim)
        q = tl.load(q_ptr + tokens[:, None] * q_token_stride + head * q_head_stride + offs_d[None, :],
                    mask=io_mask, other=0.0)
        if CACHE_DTYPE_DOTS:
            q = q.to(k_cache_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)
        block_table_ptr = block_tables_ptr + seq * block_table_stride
        # keys past the tile's last query position are masked for every row: stop there
        kv_end = tl.minimum(context_len, context_len - q_len + tile * BLOCK_M + BLOCK_M)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            is_valid = offs_n < kv_end
            k = load_kv_tile(k_cache_ptr, block_table_ptr, kv_head, offs_n, is_valid, offs_d, head_dim,
                             cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            # key 0 is visible to every row, so each row's running max is finite after tile 0
            is_visible = is_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
            scores = tl.where(is_visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = load_kv_tile(v_cache_ptr, block_table_ptr, kv_head, offs_n, is_valid, offs_d, head_dim,
                             cache_block_stride, cache_offset_stride, cache_head_stride, BLOCK_SIZE, KV_AS_F32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + tokens[:, None] * out_token_stride + head * out_head_stride + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


def extend_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton `extend_attention_ref` with the default launch (`extend_attention_with_settings`);
    no host sync (see the tiling note above)."""
    return extend_attention_with_settings(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)


def extend_attention_with_settings(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    block_m: int | None = None,  # query rows per tile (None: 16 for short chunks, else 64)
    block_n: int = 32,  # keys per tile; these and the launch settings are `gpu_check.py`'s sweep
    num_warps: int | None = None,
    num_stages: int | None = None,
    cache_dtype_dots: bool = True,  # 16-bit products on a 16-bit cache with q of its dtype (see the kernel)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`extend_attention` with its tiles, launch settings and products chosen by the caller."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    check_paged_inputs(q, k_cache, v_cache, block_tables, num_seqs)
    assert cu_seqlens_q.shape == (num_seqs + 1,), f"cu_seqlens_q must be [{num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}"
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # short chunks (speculative verification: k + 1 tokens) waste less of a 16-row tile
    if block_m is None:
        block_m = 16 if num_tokens <= 16 * num_seqs else 64
    dots_16 = cache_dtype_dots_apply(cache_dtype_dots, q.dtype, k_cache.dtype)
    settings = {k: v for k, v in dict(num_warps=num_warps, num_stages=num_stages).items() if v is not None}
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    tile_cu = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    tile_cu[1:] = torch.cumsum((q_lens + block_m - 1) // block_m, 0)
    max_tiles = triton.cdiv(num_tokens, block_m) + num_seqs
    extend_attention_kernel[(max_tiles, num_heads)](
        out, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, tile_cu,
        scale, num_seqs, head_dim, num_heads // k_cache.shape[2],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), DOT_PRECISION=dot_precision(q.dtype, k_cache.dtype),
        CACHE_DTYPE_DOTS=dots_16, KV_AS_F32=not dots_16, **settings,
    )
    return out


# --- one opaque op for a compiled step with long chunks (prefill) -------------------------
#
# `torch.compile` cannot trace the per-sequence loop above (it reads the chunk lengths on the
# host). A step whose chunks are too long for a gather plan (`AttentionMetadata.plan` is None)
# therefore reaches the tracer as this op, the K/V write and both attentions in one call, with
# every size read off its tensors' dims: one graph serves every prefill step, and Inductor fuses
# the rest of the layer (norms, rotary, SwiGLU, residual adds) around it.

_LIB = torch.library.Library("pdserve", "FRAGMENT")
_LIB.define("write_and_split_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor slot_mapping, Tensor decode_block_tables, Tensor decode_context_lens, "
            "Tensor extend_block_tables, Tensor extend_cu_seqlens_q, Tensor extend_context_lens, float scale) -> Tensor")


def write_and_split_attend(q, k, v, k_cache, v_cache, slot_mapping, decode_block_tables, decode_context_lens,
                           extend_block_tables, extend_cu_seqlens_q, extend_context_lens, scale: float) -> torch.Tensor:
    """`write_kv_ref`, then the step's decode tokens (one per sequence, first in the batch) through
    `paged_decode_attention_ref` and the rest through `extend_attention_ref`: what
    `Attention._split_attention` does eagerly. `torch.ops.pdserve.write_and_split_attend`."""
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    nd, num_tokens = decode_context_lens.shape[0], q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = paged_decode_attention_ref(q[:nd], k_cache, v_cache, decode_block_tables, decode_context_lens, scale)
    if nd < num_tokens:
        out[nd:] = extend_attention_ref(q[nd:], k_cache, v_cache, extend_block_tables, extend_cu_seqlens_q,
                                        extend_context_lens, scale)
    return out


def _write_and_split_attend_fake(q, k, v, k_cache, v_cache, slot_mapping, decode_block_tables, decode_context_lens,
                                 extend_block_tables, extend_cu_seqlens_q, extend_context_lens, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


_LIB.impl("write_and_split_attend", write_and_split_attend, "CPU")
torch.library.register_fake("pdserve::write_and_split_attend", _write_and_split_attend_fake, lib=_LIB)

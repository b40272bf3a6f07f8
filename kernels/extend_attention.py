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

from kernels.paged_attention import gather_kv


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
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1)
    return out

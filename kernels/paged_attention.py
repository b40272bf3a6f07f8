"""Paged decode attention: one query token per sequence over its paged K/V.

Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads).
Block tables are padded with any value past a sequence's blocks; entries beyond
ceil(context_len / block_size) are never read.
"""
from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [..., max_blocks] int
    length: int,
) -> torch.Tensor:
    """The first `length` cached tokens of each row: [..., length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    ids = block_table[..., :num_blocks].long().clamp(min=0)
    kv = cache[ids]  # [..., num_blocks, block_size, num_kv_heads, head_dim]
    kv = kv.reshape(*ids.shape[:-1], num_blocks * block_size, *cache.shape[2:])
    return kv[..., :length, :, :]


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_len = int(context_lens.max())
    k = gather_kv(k_cache, block_tables, max_len).float()  # [S, T, Hkv, D]
    v = gather_kv(v_cache, block_tables, max_len).float()
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", qg, k) * scale
    pad = torch.arange(max_len, device=q.device)[None, :] >= context_lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    out = torch.einsum("skgt,stkd->skgd", scores.softmax(-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)

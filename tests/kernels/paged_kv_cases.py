"""Builders shared by the attention tests: a paged KV cache holding known dense K/V, and a
dense causal attention written the obvious way (float64, explicit GQA head repeat) that checks
the references themselves."""
from __future__ import annotations

import torch


def make_paged_kv(
    context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: str, seed: int = 0,
):
    """Returns (k_dense, v_dense, k_cache, v_cache, block_tables).

    k_dense[s]: [context_lens[s], num_kv_heads, head_dim]. Blocks are handed out in a shuffled
    order so a kernel that assumes contiguous pages fails; unused block-table entries are -1
    and spare cache blocks hold large garbage so reading past a context shows.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (1e4 * torch.randn(shape, generator=gen)).to(dtype)
    v_cache = (1e4 * torch.randn(shape, generator=gen)).to(dtype)
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    k_dense, v_dense = [], []
    for s, n in enumerate(context_lens):
        ids = [order.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(n):
            k_cache[ids[t // block_size], t % block_size] = k[t]
            v_cache[ids[t // block_size], t % block_size] = v[t]
        k_dense.append(k.to(device))
        v_dense.append(v.to(device))
    return k_dense, v_dense, k_cache.to(device), v_cache.to(device), block_tables.to(device)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, H, D] the last n positions of a context whose K/V are k, v: [L, Hkv, D].

    Query i sits at position L - n + i and sees keys 0..L - n + i. float64 result [n, H, D].
    """
    n, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]: query head h reads KV head h // group
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(n, num_heads, q.shape[2], dtype=torch.float64, device=q.device)
    for i in range(n):
        visible = length - n + i + 1
        scores = torch.einsum("hd,thd->ht", q[i].double(), k[:visible]) * scale
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), v[:visible])
    return out


def assert_matches_dense(out: torch.Tensor, q: torch.Tensor, k_dense, v_dense, query_lens: list[int], scale: float,
                         tol: float = 1e-5) -> None:
    """`out` holds each sequence's queries in turn; each against `dense_causal_attention`."""
    start = 0
    for s, n in enumerate(query_lens):
        expected = dense_causal_attention(q[start:start + n], k_dense[s], v_dense[s], scale)
        torch.testing.assert_close(out[start:start + n].double(), expected, atol=tol, rtol=tol)
        start += n

"""Paged attention for a group of sequences in one dense call: the CPU path.

Each layer gathers the group's K/V blocks into a dense [num_seqs, length, num_kv_heads,
head_dim] tensor (`index_select` of whole blocks) and runs one `scaled_dot_product_attention`
over the group; what does not change between layers (which blocks, the mask, where each query
row goes) is worked out once per step by `plan_gather`. Decode (one query per sequence) and
short extends (speculative verification: k + 1 queries per sequence) both run through it.

Queries of different lengths are padded to the longest:

    flat q rows      t0 | t1 t2 t3 | t4 t5            query_lens 1, 3, 2
    padded           s0: t0 .  .
                     s1: t1 t2 t3
                     s2: t4 t5 .                      pad rows repeat row 0; dropped after

Query i of sequence s sits at position context_len[s] - query_len[s] + i and sees keys 0..that
position. Pad rows see keys up to their (fictional) position, all finite (the cache is zeroed
at allocation), so no row of the softmax is empty.

Every sequence of a dense call is padded to the longest context, and the padding costs as much
as real keys. So the plan splits the sequences (ordered by context length by the caller) into
runs whose lengths stay within a factor of each other, one call per run:

    lengths   40 44 51 60 | 130 150 170 | 390 400     three calls: 4 x 60, 3 x 170, 2 x 400 keys
                                                      instead of 9 x 400
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.kernels.kv_write import as_cache_dtype


@dataclass(slots=True)
class GatherPlan:
    """Where a group's K/V lie and how its queries line up, shared by every layer of a step."""

    block_ids: torch.Tensor  # [num_seqs, num_blocks] int64: the blocks to gather, sequence by sequence
    num_seqs: int
    max_query_len: int
    length: int  # keys per sequence: the longest context
    mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, length] bool (True: visible); None: all visible
    pad_index: torch.Tensor | None  # [num_seqs * max_query_len] int64 rows of q; None: no padding
    unpad_index: torch.Tensor | None  # [num_tokens] int64 rows of the padded output to keep
    # the dense calls: (first sequence, end sequence, keys), covering the sequences in order
    groups: list[tuple[int, int, int]]
    groups_tensor: torch.Tensor | None = None  # [num_groups, 3] int64, the same, in uniform plans
    # native plans (`kernels/native.py` attends by these instead of the mask and indices above)
    context_lens: torch.Tensor | None = None  # [num_seqs] int64
    query_starts: torch.Tensor | None = None  # [num_seqs + 1] int64: sequence s's queries are rows [qs[s], qs[s+1])


GROUP_GROWTH = 1.5  # a run of sequences ends where a context exceeds 1.5x its first one's ...
GROUP_MIN_SEQS = 4  # ... once it holds this many (each call costs a fixed ~50 us)


def group_by_length(context_lens: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of sequences for `GatherPlan.groups` (best when the lengths are sorted)."""
    groups, first = [], 0
    for i in range(1, len(context_lens) + 1):
        if i == len(context_lens) or (context_lens[i] > GROUP_GROWTH * context_lens[first]
                                      and i - first >= GROUP_MIN_SEQS):
            groups.append((first, i, max(context_lens[first:i])))
            first = i
    return groups


def plan_gather(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    context_lens: list[int],  # [num_seqs], each >= its query length
    query_lens: list[int],  # [num_seqs], each >= 1; the queries are the last tokens of each context
    block_size: int,
    uniform: bool = False,  # mask and pad/unpad indices even where not needed: one traced graph (`write_and_attend`)
    native: bool = False,  # only the block ids, lengths and query starts (`paged_attention_cpu`)
) -> GatherPlan:
    """Worked out on the host with numpy (a plan is a dozen small arrays: numpy builds them in a
    fraction of what as many torch ops cost), then handed over as tensors on the tables' device."""
    num_seqs, max_q, length = len(context_lens), max(query_lens), max(context_lens)
    device = block_tables.device
    num_blocks = -(-length // block_size)
    tables = block_tables[:, :num_blocks].cpu().numpy()
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    block_ids = as_tensor(np.maximum(tables, 0).astype(np.int64))
    if native:
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        return GatherPlan(block_ids, num_seqs, max_q, length, None, None, None, [],
                          context_lens=as_tensor(np.asarray(context_lens, dtype=np.int64)),
                          query_starts=as_tensor(starts))
    mask = None
    if uniform and num_seqs == 1 and max_q == 1:  # all visible: only its shape is read
        mask = _all_true(length, device)
    elif uniform or max_q > 1 or min(context_lens) < length:
        q_pos = (np.asarray(context_lens) - np.asarray(query_lens))[:, None] + np.arange(max_q)[None, :]  # [S, max_q]
        mask = as_tensor(np.arange(length)[None, None, :] <= q_pos[:, :, None])[:, None]  # torch's strides
    pad_index = unpad_index = None
    if min(query_lens) < max_q:
        lens = np.asarray(query_lens)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        i = np.arange(max_q)[None, :]
        pad_index = as_tensor(np.where(i < lens[:, None], starts[:, None] + i, 0).reshape(-1))
        unpad_index = as_tensor(((np.arange(num_seqs) * max_q)[:, None] + i)[i < lens[:, None]])
    elif uniform:  # no padding: the identity, both ways (two tensors: a tracer guards on aliasing)
        pad_index, unpad_index = _identity(num_seqs * max_q, device, 0), _identity(num_seqs * max_q, device, 1)
    groups = group_by_length(context_lens)
    groups_tensor = _cached(("groups", tuple(groups), str(device)),
                            lambda: torch.tensor(groups, dtype=torch.int64, device=device)) if uniform else None
    return GatherPlan(block_ids, num_seqs, max_q, length, mask, pad_index, unpad_index, groups, groups_tensor)


_CACHE: dict[tuple, torch.Tensor] = {}  # small constant tensors uniform plans reuse (never written)


def _cached(key: tuple, make) -> torch.Tensor:
    if key not in _CACHE:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        _CACHE[key] = make()
    return _CACHE[key]


def _identity(n: int, device: torch.device, copy: int) -> torch.Tensor:
    return _cached(("identity", n, str(device), copy), lambda: torch.arange(n, device=device))


def _all_true(length: int, device: torch.device) -> torch.Tensor:  # [1, 1, 1, length], contiguous strides
    row = _cached(("true", str(device)), lambda: torch.ones(1 << 16, dtype=torch.bool, device=device))
    if length > row.shape[0]:
        row = _CACHE[("true", str(device))] = torch.ones(2 * length, dtype=torch.bool, device=device)
    return row[:length].view(1, 1, 1, length)


def gathered_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: GatherPlan,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Math in float32 whatever the cache dtype, like `paged_decode_attention_ref`."""
    max_q = plan.max_query_len
    rows = q if plan.pad_index is None else q.index_select(0, plan.pad_index)  # [num_seqs * max_q, H, D]
    outs = [_attend(rows[a * max_q:b * max_q], k_cache, v_cache, plan, a, b, length, scale)
            for a, b, length in plan.groups]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    out = out if plan.unpad_index is None else out.index_select(0, plan.unpad_index)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _attend(rows, k_cache, v_cache, plan: GatherPlan, first: int, end: int, length: int, scale: float):
    """One dense call over sequences [first, end) of the plan, `length` keys each."""
    num_seqs, max_q = end - first, plan.max_query_len
    num_heads, head_dim = rows.shape[1], rows.shape[2]
    num_blocks = -(-length // k_cache.shape[1])
    ids = plan.block_ids
    if (first, end, num_blocks) != (0, plan.num_seqs, ids.shape[1]):  # a run of the plan, not all of it
        ids = ids[first:end, :num_blocks]
    ids = ids.reshape(-1)
    k = _gather(k_cache, ids, num_seqs)[:, :length].transpose(1, 2)  # [S, Hkv, T, D]
    v = _gather(v_cache, ids, num_seqs)[:, :length].transpose(1, 2)
    mask = None
    if plan.mask is not None and (num_seqs > 1 or max_q > 1):  # one query of one sequence sees all
        mask = plan.mask[first:end, :, :, :length]
    rows = rows.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)  # [S, H, max_q, D]
    out = F.scaled_dot_product_attention(_fp32(rows), _fp32(k), _fp32(v), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs, num_blocks * block_size, num_kv_heads, head_dim]: whole blocks copied as rows of
    a [num_blocks, block_size * num_kv_heads * head_dim] view, several times faster on the CPU
    than advanced indexing of the 4-D cache."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    return rows.view(num_seqs, -1, *cache.shape[2:])


# --- for graph capture ---------------------------------------------------------------------
#
# A compiler traces the step once for every shape when the K/V write and the attention are one
# opaque op whose output is shaped like q: it never reasons about the plan's sizes, which it sees
# only as the dims of tensors (`plan_gather(..., uniform=True)`: every tensor present).


_LIB = torch.library.Library("pdserve", "DEF")  # a plain library op: a tenth of `custom_op`'s call overhead
_LIB.define("write_and_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor slot_mapping, Tensor block_ids, Tensor mask, Tensor pad_index, Tensor unpad_index, "
            "Tensor groups, float scale) -> Tensor")


def write_and_attend(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    block_ids: torch.Tensor,  # a uniform plan's tensors
    mask: torch.Tensor,
    pad_index: torch.Tensor,
    unpad_index: torch.Tensor,
    groups: torch.Tensor,  # [num_groups, 3] int64: `GatherPlan.groups`
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """`write_kv_ref` then `gathered_attention`, the plan's sizes read off its tensors, and the
    indices dropped where they change nothing (an unpadded batch needs no reordering).
    `torch.ops.pdserve.write_and_attend`. Every slot is a real one (no -1 padding: that is CUDA
    graphs' business)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, as_cache_dtype(k, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, as_cache_dtype(v, v_cache.dtype))
    num_seqs, _, max_q, length = mask.shape
    is_padded = pad_index.shape[0] != q.shape[0]
    plan = GatherPlan(block_ids, num_seqs, max_q, length, mask, pad_index if is_padded else None,
                      unpad_index if is_padded else None, [tuple(g) for g in groups.tolist()])
    return gathered_attention(q, k_cache, v_cache, plan, scale).contiguous()


def _write_and_attend_fake(q, k, v, k_cache, v_cache, slot_mapping, block_ids, mask, pad_index, unpad_index, groups,
                           scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


_LIB.impl("write_and_attend", write_and_attend, "CPU")
torch.library.register_fake("pdserve::write_and_attend", _write_and_attend_fake, lib=_LIB)

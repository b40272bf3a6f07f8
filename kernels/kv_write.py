"""Writing new K/V into the paged cache by slot mapping.

Cache layout (DESIGN.md), one K and one V tensor per layer:

    k_cache[num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block      (slot -1: padding, skipped)
"""
from __future__ import annotations

import torch

from pdserve.kernels._triton import tl, triton


FLOAT16_MAX = 65504.0


def as_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as a cache of `cache_dtype` holds them: rounded to nearest even, and into a
    float16 cache under wider rows saturated at float16's largest finite value (as the native op
    writes them, `cpu/kv_rows.h`): an infinity left in a block would outlive its request, and
    padded attention rows of later ones read stale slots (0 × inf is NaN)."""
    if x.dtype == cache_dtype:
        return x
    if cache_dtype == torch.float16:
        x = x.clamp(-FLOAT16_MAX, FLOAT16_MAX)
    return x.to(cache_dtype)


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    if bool((slot_mapping < 0).any()):  # drop padding rows first (the engine sends none)
        valid = slot_mapping >= 0
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, as_cache_dtype(k, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, as_cache_dtype(v, v_cache.dtype))


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_kv_heads, head_dim,
    k_token_stride, k_head_stride, v_token_stride, v_head_stride,
    cache_block_stride, cache_offset_stride, cache_head_stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: all of its heads, K and V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < num_kv_heads) & (offs_d < head_dim)
        dst = (slot // BLOCK_SIZE) * cache_block_stride + (slot % BLOCK_SIZE) * cache_offset_stride \
            + offs_h * cache_head_stride + offs_d
        k = tl.load(k_ptr + token * k_token_stride + offs_h * k_head_stride + offs_d, mask=mask)
        v = tl.load(v_ptr + token * v_token_stride + offs_h * v_head_stride + offs_d, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Triton `write_kv_ref`, in place; slot -1 skips the token."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), "k_cache and v_cache must match"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"cache must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got {tuple(k_cache.shape)}"
    assert k_cache.stride(3) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.dtype.is_floating_point, \
        f"slot_mapping must be [{num_tokens}] integers, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        num_kv_heads, head_dim, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )

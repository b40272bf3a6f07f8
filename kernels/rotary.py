"""Rotary position embedding in the Hugging Face rotate-half convention, with rope scaling.

The cos/sin tables are built once per model (`build_rope_cache`); each step gathers its tokens'
rows once (`rope_at`), and every layer's op rotates q's and k's heads by those rows.
"""
from __future__ import annotations

import math

import torch

from pdserve.kernels._triton import tl, triton


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for rope type default/linear/llama3."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")


def build_rope_cache(
    head_dim: int, max_position: int, base: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (cos, sin), each [max_position, head_dim // 2] float32."""
    inv_freq = rope_inv_freq(head_dim, base, scaling)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def rope_at(
    cos: torch.Tensor,  # [max_position, head_dim // 2] float32, from `build_rope_cache`
    sin: torch.Tensor,  # [max_position, head_dim // 2] float32
    positions: torch.Tensor,  # [num_tokens] int
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_tokens, head_dim] in dtype
    """One step's rows of the tables, in Hugging Face's layout (each frequency twice) and in the
    activations' dtype, as transformers casts them. Gathered once per step for every layer."""
    c, s = cos[positions], sin[positions]
    return torch.cat((c, c), -1).to(dtype), torch.cat((s, s), -1).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]: q's heads, or q's and k's side by side
    cos: torch.Tensor,  # [num_tokens, head_dim] in x's dtype, from `rope_at`
    sin: torch.Tensor,  # [num_tokens, head_dim] in x's dtype
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """transformers' `apply_rotary_pos_emb`, op for op, on every head of x. The model rotates
    q's and k's heads in one call: they are neighbours in the fused qkv projection's output."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


@triton.jit
def apply_rotary_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr,
    num_heads, x_token_stride, x_head_stride, out_token_stride, out_head_stride, table_stride,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token: every head of that token, both halves at once. The
    # token's cos/sin row holds each frequency twice; the first half is enough.
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < num_heads) & (offs_d < HALF)
    dtype = x_ptr.dtype.element_ty
    c = tl.load(cos_ptr + token * table_stride + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * table_stride + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    x_base = x_ptr + token * x_token_stride + offs_h * x_head_stride + offs_d
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF, mask=mask, other=0.0).to(tl.float32)
    # Round every product and sum to x's dtype, as the reference's `x * cos + rot(x) * sin`
    # does op by op in that dtype; products of two half-precision values are exact in fp32, so
    # this reproduces the reference bit for bit.
    o1 = ((x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    out_base = out_ptr + token * out_token_stride + offs_h * out_head_stride + offs_d
    tl.store(out_base, o1, mask=mask)
    tl.store(out_base + HALF, o2, mask=mask)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim] in x's dtype, from `rope_at`
    sin: torch.Tensor,  # [num_tokens, head_dim] in x's dtype
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton `apply_rotary_ref`, into a new tensor."""
    assert x.dim() == 3 and x.stride(2) == 1, f"x must be [num_tokens, heads, head_dim] with contiguous head_dim, got {tuple(x.shape)} {x.stride()}"
    num_tokens, num_heads, head_dim = x.shape
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert x.dtype == cos.dtype == sin.dtype, f"x, cos, sin dtypes differ: {x.dtype}, {cos.dtype}, {sin.dtype}"
    assert cos.shape == sin.shape == (num_tokens, head_dim), f"cos/sin must be [{num_tokens}, {head_dim}], got {tuple(cos.shape)}"
    assert cos.stride(1) == 1 and sin.stride() == cos.stride(), "cos/sin must be row-contiguous with equal strides"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens > 0:
        apply_rotary_kernel[(num_tokens,)](
            x, out, cos, sin,
            num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return out

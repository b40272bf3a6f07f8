"""Rotary position embedding in the Hugging Face rotate-half convention, with rope scaling.

The cos/sin tables are built once per model (`build_rope_cache`); the op rotates q and k of a
flat batch of tokens by their absolute positions.
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, 1, head_dim // 2] in x.dtype
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return x * cos2 + torch.cat((-x2, x1), -1) * sin2


def apply_rotary_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int
    cos: torch.Tensor,  # [max_position, head_dim // 2] float32
    sin: torch.Tensor,  # [max_position, head_dim // 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated (q, k), computed in q's dtype like transformers' `apply_rotary_pos_emb`."""
    c = cos[positions].to(q.dtype)[:, None, :]
    s = sin[positions].to(q.dtype)[:, None, :]
    return _rotate(q, c, s), _rotate(k, c, s)


@triton.jit
def apply_rotary_kernel(
    x_ptr, out_ptr, positions_ptr, cos_ptr, sin_ptr,
    num_heads, x_token_stride, x_head_stride, out_token_stride, out_head_stride, table_stride,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token: every head of q (or k) of that token, both halves at once.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < num_heads) & (offs_d < HALF)
    dtype = x_ptr.dtype.element_ty
    # the table is cast to x's dtype first, like the reference (and transformers)
    c = tl.load(cos_ptr + pos * table_stride + offs_d, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * table_stride + offs_d, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)
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


def _rotate_launch(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1, f"head_dim must be contiguous, got strides {x.stride()}"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens > 0:
        apply_rotary_kernel[(num_tokens,)](
            x, out, positions, cos, sin,
            num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return out


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int
    cos: torch.Tensor,  # [max_position, head_dim // 2] float32
    sin: torch.Tensor,  # [max_position, head_dim // 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `apply_rotary_ref`: returns rotated (q, k) as new tensors."""
    assert q.dim() == 3 and k.dim() == 3, f"q, k must be [num_tokens, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}"
    assert q.shape[0] == k.shape[0] == positions.shape[0], "q, k and positions must agree on num_tokens"
    assert q.shape[2] == k.shape[2] and q.shape[2] % 2 == 0, f"head_dim must match and be even, got {q.shape[2]}, {k.shape[2]}"
    assert q.dtype == k.dtype, f"q and k dtypes differ: {q.dtype}, {k.dtype}"
    assert cos.shape == sin.shape and cos.shape[1] == q.shape[2] // 2, f"cos/sin must be [max_position, {q.shape[2] // 2}]"
    assert cos.stride(1) == 1 and sin.stride() == cos.stride(), "cos/sin must be row-contiguous with equal strides"
    assert not positions.dtype.is_floating_point, f"positions must be integers, got {positions.dtype}"
    return _rotate_launch(q, positions, cos, sin), _rotate_launch(k, positions, cos, sin)

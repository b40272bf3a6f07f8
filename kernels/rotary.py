"""Rotary position embedding in the Hugging Face rotate-half convention, with rope scaling.

The cos/sin tables are built once per model (`build_rope_cache`); the op rotates q and k of a
flat batch of tokens by their absolute positions.
"""
from __future__ import annotations

import math

import torch


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

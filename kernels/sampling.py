"""Sampling filters (temperature, top-k, top-p, min-p) and sampling from explicit uniforms.

The random draws are inputs (one uniform per row) so a kernel and its reference consume the
same randomness and can be compared exactly; where the draws come from (seed and position) is
the engine's business. Filters apply in the order temperature → top-k → top-p → min-p.
Per-row parameter conventions: temperature 0 = greedy (one-hot argmax), top_k 0 = off,
top_p 1 = off, min_p 0 = off.
"""
from __future__ import annotations

import torch


def _top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a token is removed. logits: [num_rows, vocab_size] float32."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop_sorted = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    # keep the smallest prefix whose mass reaches p; the top token always stays
    drop_sorted |= (mass_before >= top_p[:, None]) & (rank > 0)
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def filter_probs_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows] float
    top_k: torch.Tensor,  # [num_rows] int
    top_p: torch.Tensor,  # [num_rows] float
    min_p: torch.Tensor,  # [num_rows] float
) -> torch.Tensor:  # [num_rows, vocab_size] float32, rows sum to 1
    """The distribution a request samples from, after its own sampling parameters."""
    logits = logits.float()
    is_greedy = temperature <= 0
    scaled = logits / torch.where(is_greedy, 1.0, temperature.float())[:, None]
    scaled = scaled.masked_fill(_top_k_top_p_mask(scaled, top_k, top_p), float("-inf"))
    probs = scaled.softmax(-1)
    below_min = probs < (min_p.float() * probs.max(-1).values)[:, None]
    probs = probs.masked_fill(below_min, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    greedy = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(is_greedy[:, None], greedy, probs)


def sample_from_probs_ref(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, rows sum to ~1
    uniforms: torch.Tensor,  # [num_rows] float in [0, 1)
) -> torch.Tensor:  # [num_rows] int64
    """Inverse-CDF sampling in token-id order: the first id whose cumulative mass exceeds u.

    Zero-probability ids are never chosen, whatever u is.
    """
    cdf = probs.double().cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    ids = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return ids.clamp(max=probs.shape[-1] - 1)


def sample_ref(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: torch.Tensor,  # [num_rows]
    top_k: torch.Tensor,  # [num_rows]
    top_p: torch.Tensor,  # [num_rows]
    min_p: torch.Tensor,  # [num_rows]
    uniforms: torch.Tensor,  # [num_rows]
) -> torch.Tensor:  # [num_rows] int64
    probs = filter_probs_ref(logits, temperature, top_k, top_p, min_p)
    return sample_from_probs_ref(probs, uniforms)

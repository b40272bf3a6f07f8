"""The rejection sampler: verifies draft tokens against the target, losslessly.

The random draws are inputs (per position: an acceptance uniform and a residual uniform; one
bonus uniform per sequence), so the outcome is a pure function of the probabilities and the
draws, and the engine keys the draws by (seed, position) for reproducibility.
"""
from __future__ import annotations

import torch

from pdserve.kernels import sample_from_probs_ref

_SUM_TOL = 1e-3


def _check_rows(name: str, probs: torch.Tensor) -> None:
    if probs.numel() == 0:
        return
    if bool((probs < 0).any()):
        raise ValueError(f"{name} has negative entries")
    sums = probs.sum(-1)
    if bool(((sums - 1).abs() > _SUM_TOL).any()):
        raise ValueError(f"{name} rows must sum to 1 (got sums {sums.flatten()[:4].tolist()})")


def verify_one(
    target_probs: torch.Tensor,  # [k + 1, vocab_size]
    draft_probs: torch.Tensor,  # [k, vocab_size]
    draft_token_ids: list[int],  # [k]
    u_accept: list[float],  # [k]
    u_residual: list[float],  # [k]
    u_bonus: float,
) -> list[int]:
    """The tokens one sequence emits this step: accepted drafts, then one recovered or bonus token."""
    k = len(draft_token_ids)
    vocab = target_probs.shape[-1]
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(f"need {k + 1} target rows and {k} draft rows, got {target_probs.shape[0]} and {draft_probs.shape[0]}")
    if any(not 0 <= t < vocab for t in draft_token_ids):
        raise ValueError(f"draft token ids must be in [0, {vocab}), got {draft_token_ids}")
    _check_rows("target_probs", target_probs)
    _check_rows("draft_probs", draft_probs)
    out = []
    for i, x in enumerate(draft_token_ids):
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        if p > 0 and (q <= 0 or u_accept[i] < p / q):  # min(1, p/q) > u
            out.append(x)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        if float(residual.sum()) <= 1e-12:  # p <= q everywhere only in float noise: fall back to p
            residual = target_probs[i]
        out.append(_draw(residual / residual.sum(), u_residual[i]))
        return out
    out.append(_draw(target_probs[k], u_bonus))
    return out


def verify_greedy(
    target_argmax: list[int],  # [k + 1] the target's argmax at the last token and each draft token
    draft_token_ids: list[int],  # [k]
) -> list[int]:
    """`verify_one` for a greedy request, without the distributions: with p one-hot on the
    target's argmax, a draft token is accepted exactly when it equals that argmax, and the
    recovered (or bonus) token is the argmax at the first mismatch (or after the last draft)."""
    if len(target_argmax) != len(draft_token_ids) + 1:
        raise ValueError(f"need {len(draft_token_ids) + 1} target argmaxes, got {len(target_argmax)}")
    out = []
    for x, best in zip(draft_token_ids, target_argmax):
        out.append(best)
        if x != best:
            return out
    out.append(target_argmax[-1])
    return out


def _draw(probs: torch.Tensor, u: float) -> int:
    return int(sample_from_probs_ref(probs[None], torch.tensor([u], dtype=torch.float64))[0])

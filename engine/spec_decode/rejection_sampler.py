"""The rejection sampler: verifies draft tokens against the target, losslessly.

The random draws are inputs (per position: an acceptance uniform, and a row of exponentials
that the recovered or bonus token is raced with, should the sequence's last token land there),
so the outcome is a pure function of the probabilities and the draws, and the engine keys the
draws by (seed, position) for reproducibility.

`verify_one` is the readable reference, one sequence at a time; `verify_batch` is what the
engine runs, every sequence at once with padded tensors and no host round trip per sequence,
and is tested to give `verify_one`'s tokens exactly on the same draws.
"""
from __future__ import annotations

from typing import Callable

import torch

from pdserve.kernels import race_ref

_SUM_TOL = 1e-3
_EMPTY = 1e-12  # a residual with less mass is float noise (p <= q everywhere): draw from p


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
    noise: torch.Tensor,  # [k + 1, vocab_size]: exponentials for a last token landing at each position
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
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)  # the race needs no normalising
        if float(residual.sum()) <= _EMPTY:
            residual = target_probs[i]
        out.append(int(race_ref(residual[None], noise[i][None])[0]))
        return out
    out.append(int(race_ref(target_probs[k][None], noise[k][None])[0]))
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


def count_accepted(
    target_probs: torch.Tensor,  # [batch, max_k + 1, vocab_size]; rows past a sequence's k + 1 are padding
    draft_probs: torch.Tensor,  # [batch, max_k, vocab_size]
    draft_token_ids: torch.Tensor,  # [batch, max_k] int64 (padding: any valid id)
    num_drafts: torch.Tensor,  # [batch] int64: each sequence's k
    u_accept: torch.Tensor,  # [batch, max_k] float64
) -> torch.Tensor:  # [batch] int64: accepted drafts before the first rejection
    """The acceptance tests of `verify_one` for every sequence at once (in float64, as there)."""
    ids = draft_token_ids[..., None]
    p = target_probs[:, :-1].gather(-1, ids)[..., 0].double()
    q = draft_probs.gather(-1, ids)[..., 0].double()
    accepted = (p > 0) & ((q <= 0) | (u_accept < p / q.clamp(min=1e-300)))
    accepted &= torch.arange(accepted.shape[1], device=accepted.device)[None, :] < num_drafts[:, None]
    return accepted.long().cumprod(-1).sum(-1)


def last_token_batch(
    target_probs: torch.Tensor,  # [batch, max_k + 1, vocab_size]
    draft_probs: torch.Tensor,  # [batch, max_k, vocab_size]
    num_drafts: torch.Tensor,  # [batch] int64
    num_accepted: torch.Tensor,  # [batch] int64, from `count_accepted`
    last_noise: torch.Tensor,  # [batch, vocab_size]: each sequence's exponentials for its last token
) -> torch.Tensor:  # [batch] int64: the recovered token, or the bonus one when all were accepted
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    p = target_probs[rows, num_accepted]
    if draft_probs.shape[1] == 0:
        return race_ref(p, last_noise)
    q = draft_probs[rows, num_accepted.clamp(max=draft_probs.shape[1] - 1)]
    residual = (p - q).clamp(min=0)
    use_p = (num_accepted == num_drafts) | (residual.sum(-1) <= _EMPTY)
    return race_ref(torch.where(use_p[:, None], p, residual), last_noise)


def verify_batch(
    target_probs: torch.Tensor,  # [batch, max_k + 1, vocab_size]
    draft_probs: torch.Tensor,  # [batch, max_k, vocab_size]
    draft_token_ids: torch.Tensor,  # [batch, max_k] int64
    num_drafts: torch.Tensor,  # [batch] int64
    u_accept: torch.Tensor,  # [batch, max_k] float64
    last_noise: Callable[[list[int]], torch.Tensor],  # accepted counts -> [batch, vocab_size] exponentials
) -> list[list[int]]:
    """`verify_one` for every sequence: one host copy for the accepted counts (the last token's
    noise depends on where it lands), one for the last tokens."""
    num_accepted = count_accepted(target_probs, draft_probs, draft_token_ids, num_drafts, u_accept)
    accepted = num_accepted.tolist()
    last = last_token_batch(target_probs, draft_probs, num_drafts, num_accepted, last_noise(accepted)).tolist()
    ids = draft_token_ids.tolist()
    return [ids[b][:n] + [last[b]] for b, n in enumerate(accepted)]

"""The coupled verifier: the target draws every token with the noise plain sampling would use,
and a draft token is kept while it equals that draw.

At position t of a request with seed s, plain sampling emits y_t = argmax_v p_t(v) / E_t(v),
E_t = `rng.exponentials(s, t)` (the exponential race, i.e. Gumbel-max). A draft proposes x_t by
racing its own distribution against the same E_t. Verification computes y_t for every proposed
position in one target pass and emits y_t, y_t+1, ... while x_t = y_t, up to and including the
first mismatch (whose y is the correction) or the bonus after the last draft.

Exact, and the same tokens whatever the depth: x_t is kept only when it equals y_t, so every
emitted token is y_t computed on a prefix of y's, i.e. exactly the token plain sampling emits
at t; and y_t ~ p_t(· | y_<t) because E_t is independent of the E_<t that fixed the prefix.
So the output is a function of (seed, position) alone: with or without speculation, at any
depth, in any batch, on any worker (to the extent the target's logits are bitwise the same).

The price: x_t = y_t less often than the rejection sampler's min(1, p/q) test accepts (the
race couples p and q less tightly than the optimal 1 - TV(p, q)). `benchmarks/spec_decode.py`
measures both.
"""
from __future__ import annotations

import torch

from pdserve.kernels import race_ref


def verify_coupled_one(
    target_probs: torch.Tensor,  # [k + 1, vocab_size]
    draft_token_ids: list[int],  # [k]
    noise: torch.Tensor,  # [k + 1, vocab_size]: the exponentials of positions t .. t + k
) -> list[int]:
    """The tokens one sequence emits: the target's own draws while the drafts match them."""
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1 or noise.shape != target_probs.shape:
        raise ValueError(f"need {k + 1} target and noise rows, got {tuple(target_probs.shape)}, {tuple(noise.shape)}")
    out = []
    for i in range(k + 1):
        y = int(race_ref(target_probs[i][None], noise[i][None])[0])
        out.append(y)
        if i == k or draft_token_ids[i] != y:
            return out
    return out


def verify_coupled_batch(
    target_probs: torch.Tensor,  # [batch, max_k + 1, vocab_size]; rows past a sequence's k + 1 are padding
    draft_token_ids: torch.Tensor,  # [batch, max_k] int64
    num_drafts: torch.Tensor,  # [batch] int64
    noise: torch.Tensor,  # [batch, max_k + 1, vocab_size]
) -> list[list[int]]:
    """`verify_coupled_one` for every sequence at once; one host copy."""
    picks = race_ref(target_probs.flatten(0, 1), noise.flatten(0, 1)).view(target_probs.shape[:2])
    return emit_matching(picks, draft_token_ids, num_drafts)


def emit_matching(
    picks: torch.Tensor,  # [batch, max_k + 1] int64: the target's token at each verified position
    draft_token_ids: torch.Tensor,  # [batch, max_k] int64
    num_drafts: torch.Tensor,  # [batch] int64
) -> list[list[int]]:
    """picks[b, :n + 1], n = the drafts matching picks before the first mismatch. With greedy
    picks (the target's argmax) this is `verify_greedy` for the whole batch."""
    max_k = draft_token_ids.shape[1]
    match = picks[:, :max_k] == draft_token_ids
    match &= torch.arange(max_k, device=picks.device)[None, :] < num_drafts[:, None]
    num_accepted = match.long().cumprod(-1).sum(-1)
    rows = torch.cat([picks, num_accepted[:, None]], 1).tolist()
    return [row[:row[-1] + 1] for row in rows]

"""Presence and frequency penalties, exactly as OpenAI defines them:

    logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty

where c[j] counts how often token j was generated before the position being sampled (the
prompt does not count; a failed-over continuation's already-generated tokens, which arrive as
the prompt's tail, do: `SamplingParams.num_output_tokens_in_prompt`). They change the logits
before temperature, the filters and the draw, on every path that picks a token: plain sampling,
the prefill worker's first token, and the target's rows in speculative verification — row i of
a verified sequence counts the tokens generated so far plus the first i draft tokens, the
context that row was computed in, so the verifier stays exact against the penalized
distribution. Log-probabilities reported to clients are the model's own, before penalties.
"""
from __future__ import annotations

import torch

from pdserve.engine.sequence import Sequence


def apply_penalties_ref(
    logits: torch.Tensor,  # [vocab_size]
    generated_ids: list[int],
    presence_penalty: float,
    frequency_penalty: float,
) -> torch.Tensor:  # [vocab_size], a new tensor
    """The readable reference for one row: OpenAI's formula, token by token."""
    out = logits.clone().float()
    counts: dict[int, int] = {}
    for tok in generated_ids:
        counts[tok] = counts.get(tok, 0) + 1
    for tok, c in counts.items():
        out[tok] -= c * frequency_penalty + presence_penalty
    return out


def has_penalties(seq: Sequence) -> bool:
    return seq.params.presence_penalty != 0 or seq.params.frequency_penalty != 0


def generated_ids(seq: Sequence) -> list[int]:
    """The tokens the penalties count: the sequence's output, after any the prompt carries."""
    n = seq.params.num_output_tokens_in_prompt
    return (seq.prompt_token_ids[len(seq.prompt_token_ids) - n:] if n else []) + seq.output_token_ids


def penalize(
    logits: torch.Tensor,  # [num_rows, vocab_size]: the rows of the entries, in order
    entries: list,  # BatchEntry-likes: .seq, .num_logits, .extra_token_ids (draft tokens)
) -> torch.Tensor:  # [num_rows, vocab_size]: `logits` itself when no row has a penalty
    """Every entry's logit rows under its penalties. Row i of an entry was computed after its
    first i extra (draft) tokens, so it counts them too."""
    if not any(e.num_logits and has_penalties(e.seq) for e in entries):
        return logits
    out = logits.float().clone()
    vocab = logits.shape[-1]
    row = 0
    for e in entries:
        if e.num_logits and has_penalties(e.seq):
            p = e.seq.params
            history = generated_ids(e.seq)
            drafts = list(e.extra_token_ids or [])
            for i in range(e.num_logits):
                ids = history + drafts[:i]
                if ids:
                    counts = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab).to(out.device)
                    out[row + i] -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
        row += e.num_logits
    return out

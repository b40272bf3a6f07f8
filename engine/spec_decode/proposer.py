"""What every proposer hands the verifier, and the one protocol proposers share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.sequence import Sequence


@dataclass(slots=True)
class Proposal:
    """One sequence's draft tokens for this step and the distributions they were drawn from."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [k, vocab_size]; None: one-hot on token_ids (n-gram, or a greedy draft)
    # [k, vocab_size]: the exponentials the draft raced at the draft tokens' positions in the
    # sampling stream (`rng.SAMPLE_STREAM`; ones for a greedy request), or None where it kept
    # none; the coupled verifier draws those positions with the same rows, so it takes them
    # instead of hashing them again
    noise: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Per sequence, at most ks[i] draft tokens to follow its current tokens (engine thread,
        once per step, before the target's forward)."""

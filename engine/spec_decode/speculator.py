"""`Speculator`: the engine's one handle on speculative decoding.

Per step, for each decoding sequence: `choose_k` (the scheduler reserves KV slots for k
lookahead tokens), `propose` (draft tokens and their q), then after the target's forward
`verify` (accept / recover / bonus) and `rollback` (cut both caches back to what was accepted;
the blocks past it are freed by the engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine import rng
from pdserve.engine.sampler import param_tensors
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.depth import AdaptiveDepth
from pdserve.engine.spec_decode.draft import DraftProposer
from pdserve.engine.spec_decode.gate import SpeculationGate
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.rejection_sampler import verify_greedy, verify_one
from pdserve.kernels import KernelOps


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counters, named like the Prometheus metrics they feed."""

    num_drafts: int = 0  # verification steps with k >= 1
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the recovered/bonus token)."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    def record(self, k: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos.extend([0] * (k - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, vocab_size]; None: one-hot (n-gram, or a greedy request's draft)


class Speculator:
    def __init__(self, proposer: DraftProposer | NgramProposer, depth: AdaptiveDepth, ops: KernelOps,
                 vocab_size: int):
        self.proposer, self.depth, self.ops, self.vocab_size = proposer, depth, ops, vocab_size
        self.stats = SpecDecodeStats()
        self.gate = SpeculationGate()

    def allow(self, batch_size: int) -> bool:
        """Whether this step speculates at all: always at fixed depth; with adaptive depth, while
        the gate measures it paying at this batch size."""
        return not self.depth.adaptive or self.gate.allow(batch_size)

    def choose_k(self, seq: Sequence, batch_size: int, max_model_len: int) -> int:
        room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
        return self.depth.choose(seq, batch_size, room)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        if isinstance(self.proposer, NgramProposer):
            return [Proposal(t, None) for t in self.proposer.propose(seqs, ks)]
        return [Proposal(t, q) for t, q in self.proposer.propose(seqs, ks)]

    def verify(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor) -> list[int]:
        """logits: [k + 1, vocab_size], the target at the last token and each draft token."""
        k = len(proposal.token_ids)
        if seq.params.is_greedy:  # p is one-hot on the argmax: no filtering, no draws, no q needed
            tokens = verify_greedy(logits.argmax(-1).tolist(), proposal.token_ids)
            self.stats.record(k, len(tokens) - 1)
            self.depth.record(seq.req_id, k, len(tokens) - 1)
            return tokens
        p = self.ops.filter_probs(logits, *param_tensors([seq.params] * (k + 1), logits.device)).cpu()
        q = proposal.probs if proposal.probs is not None else self._one_hot(proposal.token_ids)
        first = seq.num_tokens  # position of the first draft token
        positions = range(first, first + k)
        tokens = verify_one(
            p, q, proposal.token_ids,
            [rng.uniform(seq.seed, pos, rng.ACCEPT_STREAM) for pos in positions],
            [rng.uniform(seq.seed, pos, rng.RESIDUAL_STREAM) for pos in positions],
            rng.uniform(seq.seed, first + k, rng.SAMPLE_STREAM),
        )
        self.stats.record(k, len(tokens) - 1)
        self.depth.record(seq.req_id, k, len(tokens) - 1)
        return tokens

    def rollback(self, seq: Sequence, num_tokens_before: int, num_accepted: int) -> None:
        """Only the K/V of the last token and the accepted drafts stay valid, in both caches."""
        seq.num_computed_tokens = num_tokens_before + num_accepted
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)

    def _one_hot(self, token_ids: list[int]) -> torch.Tensor:
        q = torch.zeros(len(token_ids), self.vocab_size)
        q[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)] = 1.0
        return q

    def forget(self, req_id: str) -> None:
        self.depth.forget(req_id)

"""Draft-model proposals: a small model with the target's tokenizer runs k steps
autoregressively, batched across sequences.

The draft has its own KV tensors but shares the target's block tables: block b holds the
target's K/V in the target cache and the draft's K/V in the draft cache. Each sequence tracks
`num_draft_computed_tokens`; the first proposal step catches the draft up on whatever it has
not seen (a fresh prompt, the last step's accepted and bonus tokens) in one pass.
"""
from __future__ import annotations

import time

import torch

from pdserve.engine import rng
from pdserve.engine.model_runner import BatchEntry, ModelRunner
from pdserve.engine.sampler import param_tensors
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.depth import LinearCost
from pdserve.engine.spec_decode.proposer import Proposal
from pdserve.kernels import KernelOps, sample_from_probs_ref


class DraftProposer:
    def __init__(self, runner: ModelRunner, ops: KernelOps, cost: LinearCost):
        self.runner, self.ops, self.cost = runner, ops, cost

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Per sequence: draft tokens and their distributions q [k, vocab_size] (None when greedy)."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        entries = [BatchEntry(seqs[i], seqs[i].num_tokens - seqs[i].num_draft_computed_tokens, 1,
                              start=seqs[i].num_draft_computed_tokens) for i in active]
        step = 0
        while active:
            picks, q = self._run(entries, [seqs[i] for i in active], step)
            for row, i in enumerate(active):
                seqs[i].num_draft_computed_tokens = entries[row].start + entries[row].num_new_tokens
                tokens[i].append(picks[row])
                if q is not None and not seqs[i].params.is_greedy:  # a greedy request's q is never read
                    probs[i].append(q[row])
            step += 1
            active = [i for i in active if ks[i] > step]
            entries = [BatchEntry(seqs[i], 1, 1, start=seqs[i].num_tokens + step - 1, extra_token_ids=tokens[i])
                       for i in active]
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _run(self, entries: list[BatchEntry], seqs: list[Sequence], step: int) -> tuple[list[int], torch.Tensor | None]:
        """One draft forward: the picked tokens and their distributions q [len(seqs), vocab_size],
        or None when every row is greedy (q is then one-hot on the pick; verification needs only
        the pick, so the filtering and the draws are skipped)."""
        start = time.perf_counter()
        logits = self.runner.execute(entries)
        if all(s.params.is_greedy for s in seqs):
            picks, q = logits.argmax(-1).tolist(), None
        else:
            q = self.ops.filter_probs(logits, *param_tensors([s.params for s in seqs], logits.device)).cpu()
            u = rng.uniforms([s.seed for s in seqs], [s.num_tokens + step for s in seqs], rng.DRAFT_STREAM)
            picks = sample_from_probs_ref(q, u).tolist()
        self.cost.observe(sum(e.num_new_tokens for e in entries), time.perf_counter() - start)
        return picks, q

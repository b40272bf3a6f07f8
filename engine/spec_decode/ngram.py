"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the sequence's
last n tokens (n from `ngram_max` down to `ngram_min`) in its prompt and output. No model;
the proposals are one-hot distributions."""
from __future__ import annotations

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.proposer import Proposal


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.propose_one(seq.token_ids, k) if k else [], None) for seq, k in zip(seqs, ks)]

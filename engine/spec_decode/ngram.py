"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the sequence's
last n tokens (n from `ngram_max` down to `ngram_min`) in its prompt and output. No model;
the proposals are one-hot distributions.

When the continuation runs into the end of the sequence, as it does in a repeating tail (the
latest match of the last n tokens is one period back), the copy carries on through what it has
just proposed, LZ77-style, so a loop of period P yields k tokens rather than P:

    tokens  a b c a b c      tail "b c" last seen at 1: continuation "a b c", then the copy
    propose a b c a ...      reads its own output ("a", ...) for as long as k asks
"""
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
                    return _copy(tokens, start + n, k)
        return []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.propose_one(seq.token_ids, k) if k else [], None) for seq, k in zip(seqs, ks)]


def _copy(tokens: list[int], src: int, k: int) -> list[int]:
    """k tokens of tokens + (what is being proposed) from src on."""
    out = tokens[src:src + k]
    while len(out) < k:
        out.append(out[len(out) - (len(tokens) - src)])  # the token one period back
    return out

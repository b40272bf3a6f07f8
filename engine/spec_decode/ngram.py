"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the sequence's
last n tokens (n from `ngram_max` down to `ngram_min`) in its prompt and output. No model;
the proposals are one-hot distributions.

When the continuation runs into the end of the sequence, as it does in a repeating tail (the
latest match of the last n tokens is one period back), the copy carries on through what it has
just proposed, LZ77-style, so a loop of period P yields k tokens rather than P:

    tokens  a b c a b c      tail "b c" last seen at 1: continuation "a b c", then the copy
    propose a b c a ...      reads its own output ("a", ...) for as long as k asks

`NgramProposer.propose_one` is the readable search, a scan back through the whole sequence for
each n: at batch 32, temperature 1 on the demo target (contexts of 100-250 tokens, where the long
n-grams rarely match and each scan runs to the start) it took 1.6 ms a step, a quarter of the
target's forward. A step proposes from each sequence's `NgramIndex` instead, which remembers
where each of its n-grams last ended and takes in only the tokens appended since the step before:
the same proposals (tested against the scan) for a few dictionary lookups a sequence. Scratch
figures (Intel Xeon): 32 random sequences of 100-228 tokens, 1.5 ms a step scanned, 0.10 ms
indexed; fixed k = 4 at batch 32, temperature 1 on the demo target, six interleaved 128-token
runs in one process, 1.07-1.10x faster; greedy, where the scan finds its match one period back,
0.99-1.01x.
"""
from __future__ import annotations

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.proposer import Proposal


class NgramIndex:
    """One sequence's n-grams, n from ngram_min to ngram_max: for each, the position just past
    its latest occurrence that ends before the sequence's last token (the tail itself is not
    its own match). Tokens are only ever appended to a sequence, so it grows with them: about
    480 bytes a token at n = 1..4 (a 2000-token sequence of random tokens, tracemalloc), 15 MB
    for 32 sequences of 1000 tokens, freed with the sequence."""

    __slots__ = ("ends", "upto", "widest")
    FEW = 8  # more new tokens than this are taken in at once (`_take`), fewer one by one

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ends: dict[int, dict] = {n: {} for n in range(ngram_max, ngram_min - 1, -1)}  # longest first
        self.upto = 0  # end positions up to this one are in `ends`
        self.widest = ngram_max

    def match(self, seq: Sequence) -> int | None:
        """Where the longest n-gram's latest earlier match ends (what follows it is the
        proposal), or None without a match; takes in the tokens appended since the last call."""
        num_tokens = seq.num_tokens
        if num_tokens <= self.upto:  # not the sequence it was built on: start again
            for ends in self.ends.values():
                ends.clear()
            self.upto = 0
        new = num_tokens - 1 - self.upto  # n-gram ends to take in: upto + 1 to num_tokens - 1
        if new > self.FEW:  # a prompt, or many steps' tokens
            self._take(seq, num_tokens)
            new = 1
        # a few ends (most steps: one), from a tuple of the last tokens, whose slices are tuples
        # (3.0 µs a proposal against 4.5 with lists, scratch)
        window = tuple(seq.last_token_ids(self.widest + max(new, 1)))
        for back in range(new, 0, -1):  # the end `back` tokens before the last
            end = num_tokens - back
            for n, ends in self.ends.items():
                if n <= end:
                    ends[window[len(window) - back - n:len(window) - back]] = end
        self.upto = num_tokens - 1
        for n, ends in self.ends.items():
            if n < num_tokens and (p := ends.get(window[len(window) - n:])) is not None:
                return p
        return None

    def _take(self, seq: Sequence, num_tokens: int) -> None:
        """The n-grams ending from upto + 1 to one before the tail's end, at once (later ends
        overwrite earlier ones: each n-gram keeps its latest)."""
        end = num_tokens - 2
        first = max(self.upto + 1 - self.widest, 0)  # the first token a new n-gram reads
        window = seq.token_slice(first, end)
        for n, ends in self.ends.items():
            lo, hi = max(self.upto + 1, n) - first, end - first  # in the window
            if lo <= hi:
                ends.update(zip(zip(*(window[lo - n + i:hi - n + i + 1] for i in range(n))), range(lo + first, hi + first + 1)))
        self.upto = end


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        """The readable search (the reference `propose` is tested against)."""
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return _copy(tokens[start + n:start + n + k], len(tokens) - start - n, k)
        return []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.propose_indexed(seq, k) if k else [], None) for seq, k in zip(seqs, ks)]

    def propose_indexed(self, seq: Sequence, k: int) -> list[int]:
        """`propose_one(seq.token_ids, k)`, from the sequence's `NgramIndex`."""
        index = seq.proposer_state
        if not isinstance(index, NgramIndex):
            index = seq.proposer_state = NgramIndex(self.ngram_min, self.ngram_max)
        src = index.match(seq)
        if src is None:
            return []
        return _copy(seq.token_slice(src, src + k), seq.num_tokens - src, k)


def _copy(head: list[int], period: int, k: int) -> list[int]:
    """k tokens: head (what follows the match, at most k), then, where the match was less than k
    tokens back, the copy carries on through its own output, one period back."""
    out = head[:k]
    while len(out) < k:
        out.append(out[len(out) - period])
    return out

"""The block pool under a property-based state machine: allocate, grow, truncate, free, prefix
reuse, with a draft model's K/V beside the target's. No block leaked or owned twice; counters
always consistent; a sequence adopting cached blocks counts as drafted only positions whose draft
K/V were computed for its own tokens."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

BLOCK = 4


def make_seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(f"r{i}", tokens, SamplingParams(), seed=0)


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks):
        self.bm = BlockManager(num_blocks, BLOCK)
        self.live: list[Sequence] = []
        self.n = 0
        # the draft cache's slots: (block, offset) -> the tokens up to and including the one whose
        # draft K/V the slot holds (K/V depend on the whole prefix)
        self.draft_slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def draft_to(self, seq: Sequence, end: int) -> None:
        """The draft computes positions [num_draft_computed_tokens, end) of the sequence."""
        tokens = seq.token_ids
        for p in range(seq.num_draft_computed_tokens, end):
            self.draft_slots[seq.block_table[p // BLOCK], p % BLOCK] = tuple(tokens[:p + 1])
        seq.num_draft_computed_tokens = max(seq.num_draft_computed_tokens, end)

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30), data=st.data())
    def admit(self, prompt, data):
        seq = make_seq(self.n, prompt)
        self.n += 1
        prefix = self.bm.match_prefix(seq)
        free_before = self.bm.num_free_blocks
        if self.bm.allocate(seq, len(prompt), prefix):
            assert len(seq.block_table) == self.bm.blocks_for(len(prompt))
            assert seq.num_computed_tokens == len(prefix) * BLOCK < len(prompt)
            assert seq.num_draft_computed_tokens <= seq.num_computed_tokens
            for p in range(seq.num_draft_computed_tokens):  # adopted draft K/V: of these very tokens
                assert self.draft_slots.get((seq.block_table[p // BLOCK], p % BLOCK)) == tuple(prompt[:p + 1])
            seq.num_computed_tokens = len(prompt)
            self.draft_to(seq, data.draw(st.integers(0, len(prompt))))
            self.bm.commit(seq)
            self.live.append(seq)
        else:
            assert not seq.block_table and self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def grow(self, data, extra):
        seq = data.draw(st.sampled_from(self.live))
        table = list(seq.block_table)
        target = seq.num_computed_tokens + extra
        if self.bm.allocate(seq, target):
            seq.output_token_ids.extend([1] * extra)
            seq.num_computed_tokens = target
            self.draft_to(seq, data.draw(st.integers(0, target)))
            self.bm.commit(seq)
        else:
            assert seq.block_table == table

    @precondition(lambda self: self.live)
    @rule(data=st.data(), back=st.integers(0, 6))
    def rollback(self, data, back):
        seq = data.draw(st.sampled_from(self.live))
        keep = max(seq.num_computed_tokens - back, seq.num_prompt_tokens)
        del seq.output_token_ids[keep - seq.num_prompt_tokens:]
        seq.num_computed_tokens = keep
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, keep)
        self.bm.truncate(seq, keep)
        assert len(seq.block_table) == self.bm.blocks_for(keep)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        self.bm.free(seq)  # idempotent
        assert not seq.block_table

    @invariant()
    def consistent(self):
        if hasattr(self, "bm"):
            self.bm.check_invariants(self.live)
            owned = len({b for s in self.live for b in s.block_table})
            assert owned + self.bm.num_free_blocks == self.bm.num_blocks


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_shares_blocks_and_survives_free():
    bm = BlockManager(8, BLOCK)
    a = make_seq(0, list(range(10)))
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.commit(a)
    b = make_seq(1, list(range(10)) + [99])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]  # two full blocks; never the block holding the last token
    assert bm.allocate(b, 11, hits)
    assert b.num_cached_tokens == 8 and bm.blocks[hits[0]].ref_count == 2
    bm.free(a)
    bm.free(b)
    c = make_seq(2, list(range(9)))
    assert bm.match_prefix(c) == hits  # freed but still cached
    bm.check_invariants([])


def test_adopted_blocks_count_as_drafted_up_to_the_first_without_draft_kv():
    bm = BlockManager(8, BLOCK)
    a = make_seq(0, list(range(13)))
    assert bm.allocate(a, 13)
    a.num_computed_tokens, a.num_draft_computed_tokens = 13, 6  # the draft has covered one block
    bm.commit(a)
    b = make_seq(1, list(range(13)))
    assert bm.allocate(b, 13, bm.match_prefix(b))
    assert (b.num_computed_tokens, b.num_draft_computed_tokens) == (12, 4)
    b.num_draft_computed_tokens = 13  # b's draft catches up; a's block 1 now has draft K/V too
    bm.commit(b)
    c = make_seq(2, list(range(13)))
    assert bm.allocate(c, 13, bm.match_prefix(c))
    assert c.num_draft_computed_tokens == 12
    for s in (a, b, c):
        bm.free(s)
    other = make_seq(3, [50] * 32)  # takes every block: none keeps its draft mark
    assert bm.allocate(other, 32)
    assert not any(bm.blocks[i].has_draft for i in other.block_table)


def test_a_prefix_with_draft_stops_at_the_first_block_without_the_drafts_kv_until_marked():
    """A speculating decode worker's reservation adopts only blocks holding both models' K/V; a
    transfer that delivered the draft's marks the prompt's blocks (`mark_drafted`)."""
    bm = BlockManager(8, BLOCK)
    a = make_seq(0, list(range(13)))
    assert bm.allocate(a, 13)
    a.num_computed_tokens = 13  # the target's K/V of every block, the draft's of none
    bm.commit(a)
    b = make_seq(1, list(range(13)))
    assert len(bm.match_prefix(b)) == 3 and bm.match_prefix(b, with_draft=True) == []
    drafted = a.block_table[:2]
    bm.mark_drafted(drafted)
    assert bm.match_prefix(b, with_draft=True) == drafted
    bm.free(a)
    assert bm.match_prefix(b, with_draft=True) == drafted  # freed, still cached with both
    bm.check_invariants([])


def test_eviction_takes_unhashed_blocks_then_a_chain_tail_first():
    bm = BlockManager(4, BLOCK)
    a = make_seq(0, list(range(8)))
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    head = a.block_table[0]
    bm.free(a)
    big = make_seq(1, [50] * 9)  # needs 3 blocks: the two unhashed ones, then one cached
    assert bm.allocate(big, 9)
    # a chain is freed tail first, so the tail is evicted and the reusable head survives
    assert bm.match_prefix(make_seq(2, list(range(8)) + [1])) == [head]


def test_allocation_is_all_or_nothing():
    bm = BlockManager(3, BLOCK)
    seq = make_seq(0, [1] * 20)
    assert not bm.allocate(seq, 20)
    assert seq.block_table == [] and bm.num_free_blocks == 3


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0)])
def test_bad_pool_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(num_blocks, block_size)

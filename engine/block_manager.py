"""`BlockManager`: the paged KV cache's block pool, with prefix caching. Holds no torch.

Each block holds `block_size` tokens of K/V for every layer. A block is owned by the sequences
whose block tables list it (`ref_count`); with ref_count 0 it sits in the free list. A full
block whose K/V are computed gets a hash chained from the block before it, so a later prompt
with the same prefix finds it (`match_prefix`) and reuses it instead of recomputing. Free
blocks with a hash stay findable until the pool needs them, least recently freed first:

    free list:  [unhashed … | hashed, least recently freed … most recently freed]
                 ^ taken first

With a draft model, a block also holds the draft's K/V of its tokens (the draft's cache shares the
target's block tables). `has_draft` says they are computed: set by `commit` on the blocks a
sequence's draft has covered. A sequence adopting cached blocks starts its draft after the leading
ones that have them, instead of running the draft over the whole prompt again: with a 64-128-token
prompt cached but for its last block, that was most of a speculative request's prefill (a draft
prefill of 1.0-1.6 ms beside the target's 1.4-2.1 ms on the Xeon, demo pair; scratch timing).

Every mutation either succeeds whole or changes nothing.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    has_draft: bool = False  # the draft model's K/V of these tokens are computed too


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block_id

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks owned by a sequence (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def match_prefix(self, seq: Sequence, with_draft: bool = False) -> list[int]:
        """Cached blocks holding a prefix of the sequence's tokens; never the last token, whose
        logits must be computed. with_draft: only the leading ones holding the draft's K/V too.
        Pure: changes nothing."""
        if not self.enable_prefix_caching:
            return []
        hits, prev = [], None
        tokens = seq.token_ids
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            block_id = self._cached.get(hash((prev, chunk)))
            block = self.blocks[block_id] if block_id is not None else None
            if block is None or block.token_ids != chunk or with_draft and not block.has_draft:
                break
            hits.append(block_id)
            prev = block.hash
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> bool:
        need = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(prefix))
        reclaimed = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        return need + reclaimed <= len(self._free)

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Grow the block table to cover `num_tokens` tokens, first adopting `prefix` (from
        `match_prefix`, only for a sequence that holds no blocks). False, and no change, if the
        pool is short."""
        assert not prefix or not seq.block_table, "a prefix is adopted only by an empty table"
        if not self.can_allocate(seq, num_tokens, prefix):
            return False
        for block_id in prefix:
            self._ref(block_id)
            seq.block_table.append(block_id)
        if prefix:
            seq.num_computed_tokens = seq.num_cached_tokens = len(prefix) * self.block_size
            drafted = next((i for i, b in enumerate(prefix) if not self.blocks[b].has_draft), len(prefix))
            seq.num_draft_computed_tokens = drafted * self.block_size
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free())
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence. Idempotent."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []

    def pin(self, block_ids: list[int]) -> None:
        """Keep these blocks allocated, whatever their sequence does, until `unpin`: a transfer
        still writing into them (the draft's K/V of a sequence already decoding)."""
        for block_id in block_ids:
            self._ref(block_id)

    def unpin(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            self._unref(block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks covering the first `num_tokens` tokens (speculative rollback)."""
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]

    def commit(self, seq: Sequence) -> None:
        """Hash the sequence's full blocks whose K/V are computed, making them reusable, and mark
        those whose draft K/V are computed too (`has_draft`).

        Hashed blocks always form a prefix of a block table, so only the blocks after the last
        hashed one are visited: O(new blocks) per step, not O(blocks); likewise the marked ones."""
        if not self.enable_prefix_caching:
            return
        table = seq.block_table
        drafted = min(seq.num_draft_computed_tokens, seq.num_computed_tokens) // self.block_size
        while drafted > 0 and not self.blocks[table[drafted - 1]].has_draft:
            drafted -= 1
            self.blocks[table[drafted]].has_draft = True
        full = seq.num_computed_tokens // self.block_size
        first = full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1
        if first == full:
            return
        prev = self.blocks[seq.block_table[first - 1]].hash if first else None
        tokens = seq.token_ids
        for i in range(first, full):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            block.hash = hash((prev, block.token_ids))
            self._cached.setdefault(block.hash, block.block_id)
            prev = block.hash

    def mark_drafted(self, block_ids: list[int]) -> None:
        """These blocks, a prefix of some block table, hold the draft's K/V of their tokens too
        (a decode worker's transfer delivered them)."""
        for block_id in block_ids:
            self.blocks[block_id].has_draft = True

    # ---- internals -----------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is None:
                self._free.move_to_end(block_id, last=False)  # nothing to keep: reuse first

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]
        block.hash, block.token_ids, block.ref_count, block.has_draft = None, (), 1, False
        return block_id

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Every block is free xor owned, ref counts equal owners; for tests and debugging."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.req_id} owns a block twice"
            hashed = [self.blocks[b].hash is not None for b in seq.block_table]
            assert hashed == sorted(hashed, reverse=True), f"{seq.req_id}'s hashed blocks are not a prefix"
            for block_id in seq.block_table:
                owners[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], f"block {block.block_id} ref count off"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id} free list off"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h, f"cache entry for block {block_id} is stale"

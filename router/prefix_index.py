"""`PrefixIndex`: which prompt prefixes a worker's prefix cache probably holds, as the router can
know it without asking: the block-aligned prefixes of the prompts it recently sent to a prefill
worker, and of the prompts and answers a decode worker recently finished. Each full block of a
prompt is keyed by a hash chained from the block before it, the way the engine's block manager
keys its cache, so a lookup walks a new prompt's blocks until the first one never sent. Bounded,
least recently used first out (the worker evicts too).
"""
from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_blocks: int = 8192):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def _chain(prompt_ids: list[int], block_size: int):
        prev = None
        for i in range((len(prompt_ids) - 1) // block_size):  # never the last token, as the engine
            prev = hash((prev, tuple(prompt_ids[i * block_size:(i + 1) * block_size])))
            yield prev

    def match(self, prompt_ids: list[int], block_size: int) -> int:
        """Tokens of the longest block-aligned prefix of `prompt_ids` sent here recently."""
        n = 0
        for h in self._chain(prompt_ids, block_size):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += block_size
        return n

    def insert(self, prompt_ids: list[int], block_size: int) -> None:
        for h in self._chain(prompt_ids, block_size):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)

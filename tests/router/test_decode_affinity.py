"""The router's choice of a decode worker (`WorkerPool.decode_candidates`): the least loaded, but
first, of those nearly as loaded (`AFFINITY_SLACK`), the one whose prefix cache probably holds
the prompt's start. The workers are the pool's own, as if they had passed their checks."""
from __future__ import annotations

import asyncio

from pdserve.router.workers import AFFINITY_SLACK, WorkerPool
from pdserve.v1 import worker_pb2

SLOTS = 32


async def _order(in_flight: dict[str, int], served: dict[str, list[int]], prompt: list[int]) -> list[str]:
    pool = WorkerPool(is_disaggregated=False)
    try:
        for name in ("x", "y", "z"):
            w = pool.add(name, "decode", f"127.0.0.1:{9 + len(name)}")  # never dialled
            w.healthy, w.info = True, worker_pb2.WorkerInfo(block_size=16)
            w.stats = worker_pb2.WorkerStats(max_num_seqs=SLOTS, num_free_blocks=100)
            w.num_in_flight = in_flight.get(name, 0)
            for tokens in served.get(name, ()):
                w.prefixes.insert(tokens, 16)
        return [w.worker_id for w in pool.decode_candidates(prompt)]
    finally:
        await asyncio.gather(*(w.channel.close() for w in pool.workers.values()))


def order(in_flight, served, prompt):
    return asyncio.run(_order(in_flight, served, prompt))


TURN_1 = list(range(100, 180))  # a conversation's first prompt and answer: 5 blocks
TURN_2 = TURN_1 + [7, 8, 9]


def test_the_next_turn_goes_where_its_start_is_cached_while_that_worker_is_nearly_as_idle():
    near = int(AFFINITY_SLACK * SLOTS)  # requests more than the least loaded, still near
    assert order({"x": near, "y": 0, "z": 1}, {"x": [TURN_1]}, TURN_2) == ["x", "y", "z"]
    # too loaded: the least loaded order alone
    assert order({"x": near + 1, "y": 0, "z": 1}, {"x": [TURN_1]}, TURN_2) == ["y", "z", "x"]


def test_the_longest_cached_start_wins_and_no_hit_keeps_the_least_loaded_order():
    assert order({"x": 0, "y": 1, "z": 2}, {"y": [TURN_1[:32]], "z": [TURN_1]}, TURN_2) == ["z", "x", "y"]
    assert order({"x": 2, "y": 0, "z": 1}, {"x": [list(range(500, 580))]}, TURN_2) == ["y", "z", "x"]
    assert order({"x": 2, "y": 0, "z": 1}, {"x": [TURN_1]}, []) == ["y", "z", "x"]  # no prompt: the order alone

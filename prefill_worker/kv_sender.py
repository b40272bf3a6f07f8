"""`KVSender`: one request's KV push, fed by the engine thread and drained by a gRPC call.

The engine thread calls `send` with each layer's K/V as soon as the layer finishes, and
`finish` with the first token; each becomes `KVChunk` messages (data split to stay under
`max_chunk_bytes`, numbered, crc32-checked) queued on the asyncio loop, where `messages()`
hands them to the PushKV client stream in order:

    header ─► data 0 ─► data 1 ─► ... ─► trailer(num_chunks, first_token)

A failure before the trailer (`fail`) ends the stream early; the decode side then reports a
truncated transfer and frees its blocks.
"""
from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np

from pdserve.engine.disagg import KVGroupLayout
from pdserve.v1 import worker_pb2

_END = object()


class KVSender:
    def __init__(self, aio_loop: asyncio.AbstractEventLoop, transfer_id: str, num_tokens: int, dtype: str,
                 groups: list[KVGroupLayout], max_chunk_bytes: int):
        self.transfer_id = transfer_id
        self._aio = aio_loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._max_chunk_bytes = max_chunk_bytes
        self.num_chunks = 0
        self.num_bytes = 0
        self.first_token: int | None = None
        self.error: str | None = None
        self.created_at = time.perf_counter()
        self.finished_at: float | None = None  # when the trailer was queued
        header = worker_pb2.KVHeader(transfer_id=transfer_id, num_tokens=num_tokens, dtype=dtype, groups=[
            worker_pb2.KVGroupLayout(name=g.name, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                     head_dim=g.head_dim) for g in groups])
        self._queue.put_nowait(worker_pb2.KVChunk(header=header))

    # ---- engine thread -------------------------------------------------------------------
    def send(self, group: int, layer: int, token_start: int,
             kv: np.ndarray) -> None:  # kv: [2, num_tokens, num_kv_heads, head_dim], K then V, contiguous
        num_tokens = kv.shape[1]
        per_token = 2 * kv[0, 0].nbytes
        step = max(1, self._max_chunk_bytes // per_token)
        for s in range(0, num_tokens, step):
            data = kv[:, s:s + step].tobytes()  # the one copy into the message's bytes
            msg = worker_pb2.KVData(seq=self.num_chunks, group=group, layer=layer, token_start=token_start + s,
                                    num_tokens=min(step, num_tokens - s), data=data, crc32=zlib.crc32(data))
            self.num_chunks += 1
            self.num_bytes += len(data)
            self._put(worker_pb2.KVChunk(data=msg))

    def finish(self, first_token: int) -> None:
        self.first_token = first_token
        self.finished_at = time.perf_counter()
        self._put(worker_pb2.KVChunk(trailer=worker_pb2.KVTrailer(num_chunks=self.num_chunks,
                                                                  first_token_id=first_token)))
        self._put(_END)

    def fail(self, reason: str) -> None:
        self.error = reason
        self._put(_END)

    def _put(self, item) -> None:
        self._aio.call_soon_threadsafe(self._queue.put_nowait, item)

    # ---- asyncio loop --------------------------------------------------------------------
    async def messages(self):
        while (item := await self._queue.get()) is not _END:
            yield item

"""`KVSender`: one request's K/V as a message stream, fed by the engine thread and drained by
the KV transport on the asyncio loop.

The engine thread calls `send` with each layer's K/V as soon as the layer finishes, and
`finish` with the first token; each becomes `KVData` messages (split to stay under
`max_chunk_bytes`, numbered, crc32-checked), queued in order behind the header:

    header ─► data 0 ─► data 1 ─► ... ─► trailer(num_chunks, first_token)

`fail` ends the stream early; the decode side then reports a truncated transfer and frees its
blocks.
"""
from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np

from pdserve.serving.kv_transfer import KVData, KVHeader, KVTrailer

_END = object()


class KVSender:
    def __init__(self, aio_loop: asyncio.AbstractEventLoop, header: KVHeader, max_chunk_bytes: int):
        self._aio = aio_loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._max_chunk_bytes = max_chunk_bytes
        self.num_chunks = 0
        self.num_bytes = 0
        self.first_token: int | None = None
        self.error: str | None = None
        self.created_at = time.perf_counter()
        self.first_layer_at: float | None = None  # when the first K/V were queued (prefill began)
        self.finished_at: float | None = None  # when the trailer was queued (first token sampled)
        self._queue.put_nowait(header)

    # ---- engine thread -------------------------------------------------------------------
    def send(self, group: int, layer: int, token_start: int,
             kv: np.ndarray) -> None:  # kv: [2, num_tokens, num_kv_heads, head_dim], K then V, contiguous
        if self.first_layer_at is None:
            self.first_layer_at = time.perf_counter()
        num_tokens = kv.shape[1]
        per_token = 2 * kv[0, 0].nbytes
        step = max(1, self._max_chunk_bytes // per_token)
        for s in range(0, num_tokens, step):
            data = kv[:, s:s + step].tobytes()  # the one copy into the message's bytes
            self._put(KVData(self.num_chunks, group, layer, token_start + s, min(step, num_tokens - s), data,
                             zlib.crc32(data)))
            self.num_chunks += 1
            self.num_bytes += len(data)

    def finish(self, first_token: int, logprobs: list[tuple[int, float]] | None = None) -> None:
        self.first_token = first_token
        self.finished_at = time.perf_counter()
        self._put(KVTrailer(self.num_chunks, first_token, tuple(logprobs) if logprobs else None))
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

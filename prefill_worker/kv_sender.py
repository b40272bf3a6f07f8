"""`KVSender`: one request's K/V as a message stream, fed by the engine thread and drained by
the KV transport on the asyncio loop.

The engine thread calls `send` with each layer's K/V (or, when the KV cache lives in shared
memory, `send_slots` with the slots that hold them), and `end_of_prompt` after the step that
completed the prompt; the loop calls `finish` with the first token. Each layer becomes `KVData`
messages (split to stay under `max_chunk_bytes`, numbered, CRC-32C-checked), queued in order
behind the header; the trailer follows once both ends are done:

    header ─► data 0 ─► data 1 ─► ... ─► trailer(num_chunks, first_token)

Handing a message to the asyncio loop wakes it, and on a prefill worker that has one core the
loop then takes that core (and the GIL) from the forward pass. On this project's 2-core machine,
a short prompt's layer hooks took 7-10 ms of its 40-75 ms prefill when every layer woke the
loop, and 3-4 ms with batches. So the engine thread collects messages and hands them over in
batches of at least `max_chunk_bytes` (a long prompt still streams layer by layer, a short one
goes in one batch, with `end_of_prompt`).

With a draft model and a decode worker that starts on the target's K/V (`targets_first`), the
engine thread calls `target_done` once the target's K/V are handed over, before the draft's pass
over the prompt: a `KVTargetReady` with the first token follows them, as soon as both are known.

`fail` ends the stream early; the decode side then reports a truncated transfer and frees its
blocks. `abandon` ends it with a trailer that says the request ended: the decode side frees the
blocks and counts no failure.
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from pdserve.engine.kv_copy import copy_rows, crc32c, rows_crc32c
from pdserve.serving.kv_transfer import KVData, KVHeader, KVTargetReady, KVTrailer
from pdserve.serving.kv_transfer.grpc_transport import data_chunk_in_place
from pdserve.serving.kv_transfer.shm import copy_pieces, split_runs

_END = object()


class KVSender:
    def __init__(self, aio_loop: asyncio.AbstractEventLoop, header: KVHeader, max_chunk_bytes: int,
                 targets_first: bool = False):
        """targets_first: the decode worker starts decoding on the target's K/V (`target_done`)."""
        self._aio = aio_loop
        self.targets_first = targets_first
        self._target_chunks: int | None = None  # loop: the target's data chunks, once `target_done` said
        self._target_ready_sent = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._max_chunk_bytes = max_chunk_bytes
        self.num_chunks = 0
        self.num_bytes = 0
        self._pending: list = []  # engine thread: messages not yet handed to the loop
        self._pending_bytes = 0
        self.num_handoffs = 0  # batches handed to the loop (wake-ups)
        self.first_token: int | None = None
        self._first_logprobs = None
        self._tail_handed = False  # loop: the engine thread handed over the prompt's last K/V
        self._ended = False  # loop: the trailer (or a failure) ended the stream
        self.abandoned = False  # loop: `abandon` ended it
        self.error: str | None = None
        self.created_at = time.perf_counter()
        self.first_layer_at: float | None = None  # when the first K/V were queued (prefill began)
        self.finished_at: float | None = None  # when the trailer was queued (first token sampled)
        # set on the loop once the first token is out to the caller (or will not be: a call that
        # waits for the whole push, a request that ended); the engine thread may wait for it
        self.first_sent = threading.Event()
        self._queue.put_nowait(header)

    # ---- engine thread -------------------------------------------------------------------
    def send(self, group: int, layer: int, token_start: int,
             kv: np.ndarray) -> None:  # kv: [2, num_tokens, num_kv_heads, head_dim], K then V, contiguous
        """K/V bytes (`engine.disagg.read_kv`'s array, owned by this sender from now on)."""
        self.began()
        num_tokens = kv.shape[1]
        per_token = 2 * kv[0, 0].nbytes
        step = max(1, self._max_chunk_bytes // per_token)
        for s in range(0, num_tokens, step):
            # the whole layer fits in one chunk: its array's own bytes, no copy here (the
            # transport's framing makes the one copy into the message); else a contiguous piece
            part = kv if step >= num_tokens else np.ascontiguousarray(kv[:, s:s + step])
            data = memoryview(part).cast("B")
            self._data(group, layer, token_start + s, min(step, num_tokens - s), data, crc32c(part))

    def send_rows(self, group: int, layer: int, token_start: int, runs: list[tuple[int, int]],
                  k_cache: np.ndarray, v_cache: np.ndarray) -> None:
        """K/V in our own host cache, by the slots that hold them ((first slot, number of slots)
        runs in token order; the caches raw [num_slots, num_kv_heads, head_dim] views of one
        layer), for a peer that needs the bytes: each chunk is checksummed where it lies, then
        copied once, into its gRPC message (`host_chunks`)."""
        self.began()
        for d in host_chunks(self.num_chunks, group, layer, token_start, runs, k_cache, v_cache,
                             self._max_chunk_bytes):
            self._append(d, len(d.data))

    def send_slots(self, group: int, layer: int, token_start: int, runs: list[tuple[int, int]],
                   k_cache: np.ndarray, v_cache: np.ndarray) -> None:
        """K/V that stay in the shared-memory cache: the chunk names the slots that hold them, as
        (first slot, number of slots) runs (`shm.slot_runs`); their bytes are checksummed here, so
        the decode side can verify its copy. The caches are raw [num_slots, num_kv_heads, head_dim]
        views of one layer."""
        self.began()
        # a peer off this node gets these as bytes chunks: the same cut and the same checksums
        for offset, part, num_tokens, num_bytes, crc in checked_parts(runs, k_cache, v_cache, self._max_chunk_bytes):
            self._data(group, layer, token_start + offset, num_tokens, b"", crc, tuple(x for run in part for x in run),
                       num_bytes=num_bytes)

    def send_refs(self, group: int, layer: int, token_start: int, runs: list[tuple[int, int]],
                  bytes_per_token: int) -> None:
        """K/V that the transport reads out of our cache itself, wherever it lies (a device:
        `DistTransport`): each chunk names the slots that hold them, as (first slot, number of
        slots) runs, and the transport computes their checksum where it reads them."""
        self.began()
        step = max(1, self._max_chunk_bytes // bytes_per_token)
        for s, part in enumerate(split_runs(runs, step)):
            num_tokens = sum(n for _, n in part)
            self._data(group, layer, token_start + s * step, num_tokens, b"", 0, tuple(x for run in part for x in run),
                       num_bytes=num_tokens * bytes_per_token)

    def began(self, at: float | None = None) -> None:
        """The prefill computed this request's first K/V (their messages may come later); `at`:
        when the pass that computed them began (perf_counter), when told after a whole pass."""
        if self.first_layer_at is None:
            self.first_layer_at = time.perf_counter() if at is None else at

    def end_of_prompt(self) -> None:
        """After the step that completed the prompt (its first token already posted to the loop):
        what is left goes to the loop, and the trailer follows it once the loop has the token."""
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        self.num_handoffs += 1
        self._aio.call_soon_threadsafe(self._put_tail, batch)

    def target_done(self) -> None:
        """After the target's K/V of the whole prompt, before the draft's: they go to the loop
        now, and with `targets_first` a `KVTargetReady` follows them once the first token is
        known (the decode side may start on them)."""
        self.flush()
        if self.targets_first:
            self._aio.call_soon_threadsafe(self._put_target_ready, self.num_chunks)

    def flush(self) -> None:
        """What is queued here goes to the loop now, not when it reaches max_chunk_bytes."""
        if self._pending:
            self._hand_over()

    def _data(self, group, layer, token_start, num_tokens, data, crc, src_runs=(), num_bytes=None) -> None:
        self._append(KVData(self.num_chunks, group, layer, token_start, num_tokens, data, crc, src_runs),
                     len(data) if num_bytes is None else num_bytes)

    def _append(self, d: KVData, num_bytes: int) -> None:
        self._pending.append(d)
        self.num_chunks += 1
        self.num_bytes += num_bytes
        self._pending_bytes += num_bytes
        if self._pending_bytes >= self._max_chunk_bytes:
            self._hand_over()

    def _hand_over(self) -> None:
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        self.num_handoffs += 1
        self._aio.call_soon_threadsafe(self._put_all, batch)

    # ---- asyncio loop --------------------------------------------------------------------
    def finish(self, first_token: int, logprobs: list[tuple[int, float]] | None = None) -> None:
        """The first token, on the loop, once the engine delivered it."""
        self.first_token, self._first_logprobs = first_token, tuple(logprobs) if logprobs else None
        self.finished_at = time.perf_counter()
        self._target_ready_if_known()
        self._end_if_complete()

    def abandon(self) -> None:
        """On the loop: the request ended, so the transfer has no use: unless the trailer is out
        already, end the stream with one that says so (the decode side then ends the reservation
        as cancelled, where a stream that just stopped would count as a failed transfer)."""
        if not self._ended:
            self.abandoned = True
            # a chunk count one past what was sent: a decode worker too old to know `abandoned`
            # fails the transfer on it (and frees the blocks) instead of activating the request
            self._end_with(KVTrailer(self.num_chunks + 1, 0, abandoned=True))

    def fail(self, reason: str) -> None:
        """On the loop: end the stream (messages not yet handed over are dropped)."""
        self.error = reason
        if not self._ended:
            self._end_with()

    def _put_all(self, items: list) -> None:
        if self._ended:
            return
        if items and self._target_chunks is not None:  # the draft's K/V: too late for a KVTargetReady
            self._target_ready_sent = True
        for item in items:
            self._queue.put_nowait(item)

    def _put_tail(self, items: list) -> None:
        self._put_all(items)
        self._tail_handed = True
        self._end_if_complete()

    def _put_target_ready(self, num_chunks: int) -> None:
        self._target_chunks = num_chunks
        self._target_ready_if_known()

    def _target_ready_if_known(self) -> None:
        """`KVTargetReady`, once `target_done` said and the first token is known, whichever came
        first (before the trailer, which `end_of_prompt` queues after it)."""
        if (self._ended or self._target_ready_sent or self._target_chunks is None or self.first_token is None
                or self._tail_handed):
            return
        self._target_ready_sent = True
        self._queue.put_nowait(KVTargetReady(self._target_chunks, self.first_token, self._first_logprobs))

    def _end_if_complete(self) -> None:
        """The trailer, once the engine thread is done with this request (`end_of_prompt`; its
        chunk count is final) and the first token is known, whichever came first."""
        if self._ended or not self._tail_handed or self.first_token is None:
            return
        self._end_with(KVTrailer(self.num_chunks, self.first_token, self._first_logprobs))

    def _end_with(self, *last) -> None:
        """The stream's last messages, then its end; nothing is queued after."""
        self._ended = True
        for item in (*last, _END):
            self._queue.put_nowait(item)

    async def messages(self):
        while (item := await self._queue.get()) is not _END:
            yield item


def checked_parts(runs: list[tuple[int, int]], k_cache: np.ndarray, v_cache: np.ndarray, max_chunk_bytes: int):
    """The slots' runs (in token order) cut into chunks of at most max_chunk_bytes: per chunk its
    first token's offset, its runs, tokens, bytes, and the CRC-32C of its rows where they lie (K of
    every token, then V: the bytes' checksum)."""
    per_token = 2 * k_cache[0].nbytes
    step = max(1, max_chunk_bytes // per_token)
    for s, part in enumerate(split_runs(runs, step)):
        num_tokens = sum(n for _, n in part)
        yield s * step, part, num_tokens, num_tokens * per_token, rows_crc32c(k_cache, v_cache, part)


def host_chunks(first_seq: int, group: int, layer: int, token_start: int, runs: list[tuple[int, int]],
                k_cache: np.ndarray, v_cache: np.ndarray, max_chunk_bytes: int) -> list[KVData]:
    """One layer's K/V for the slots' runs (in token order) as data chunks of at most
    max_chunk_bytes, numbered from first_seq, each made in its gRPC message: its CRC-32C read
    where the rows lie, then the rows copied once, into the message (`copy_rows`). Before, the
    engine thread gathered the rows (`read_kv`) and checksummed them, a layer over
    max_chunk_bytes was copied again per chunk, and the transport copied every chunk into its
    message: three copies of a long prompt's K/V on the prefill worker, now one."""
    out = []
    for seq, (offset, part, num_tokens, num_bytes, crc) in enumerate(
            checked_parts(runs, k_cache, v_cache, max_chunk_bytes), first_seq):
        wire, payload = data_chunk_in_place(seq, group, layer, token_start + offset, num_tokens, crc, num_bytes)
        kv = payload.view(k_cache.dtype).reshape(2, num_tokens, *k_cache.shape[1:])
        if copy_rows((k_cache, v_cache), (kv[0], kv[1]), copy_pieces(part, np.arange(num_tokens))) != crc:
            raise RuntimeError(f"KV chunk {seq} changed while it was copied into its message")
        out.append(KVData(seq, group, layer, token_start + offset, num_tokens, memoryview(payload), crc, wire=wire))
    return out

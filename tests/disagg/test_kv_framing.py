"""The PushKV stream's framing, both ends: what `GrpcTransport` puts in each gRPC message
(`_Batches`: what is ready at once in one `KVBatch`, bulk chunks alone) and what the decode
side's `decode_chunk` makes of it, checked against protobuf's own parser."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from pdserve.engine.disagg import KVGroupLayout, raw_layer, read_kv
from pdserve.engine.kv_copy import crc32c
from pdserve.prefill_worker.kv_sender import host_chunks
from pdserve.serving.kv_transfer import KVData, KVHeader, KVShm, KVTargetReady, KVTrailer, TransferError
from pdserve.serving.kv_transfer.grpc_transport import (BATCH_BYTES, GrpcTransport, _Batches, add_decode_worker_servicer,
                                                         data_chunk_in_place, decode_chunk, encode_chunk, from_proto)
from pdserve.v1 import worker_pb2, worker_pb2_grpc

HEADER = KVHeader("ticket", 6, "float32", (KVGroupLayout("target", 2, 2, 8),), KVShm(("seg",), 64))


def shm_chunk(seq: int) -> KVData:
    return KVData(seq, 0, seq, 0, 6, b"", 1000 + seq, (10, 6))


def bytes_chunk(seq: int, n: int) -> KVData:
    return KVData(seq, 0, seq, 0, 6, np.arange(n, dtype=np.uint8).tobytes(), 7, ())


def wire(bursts: list[list]) -> list[bytes]:
    """The gRPC messages `_Batches` makes of messages that arrive in bursts (a wait between)."""
    async def source():
        for burst in bursts:
            await asyncio.sleep(0.01)
            for msg in burst:
                yield msg

    async def go():
        return [m async for m in _Batches(source())]

    return asyncio.run(go())


def flat(raw_messages: list[bytes]) -> list:
    out = []
    for raw in raw_messages:
        got = decode_chunk(raw)
        assert not isinstance(got, TransferError), got
        out += got if isinstance(got, list) else [got]
    return out


def test_what_is_ready_at_once_goes_in_one_message_and_decodes_as_sent():
    trailer = KVTrailer(3, 42, ((42, -0.25),))
    sent = [[HEADER], [shm_chunk(0), shm_chunk(1), shm_chunk(2), trailer]]
    raw = wire(sent)
    assert len(raw) == 2  # the header alone (it came first), then the rest as one batch
    assert worker_pb2.KVChunk.FromString(raw[1]).WhichOneof("part") == "batch"
    assert flat(raw) == [m for burst in sent for m in burst]
    # protobuf's parser reads the same parts
    parts = worker_pb2.KVChunk.FromString(raw[1]).batch.parts
    assert [from_proto(p) for p in parts] == sent[1]


def test_a_target_ready_mark_travels_in_its_place_in_a_batch():
    """`KVTargetReady` (the target's K/V complete, the first token with its log-probs) between
    the target's chunks and the draft's, batched with them, decodes as sent."""
    ready = KVTargetReady(2, 42, ((42, -0.25), (7, -1.5)))
    sent = [[HEADER], [shm_chunk(0), shm_chunk(1), ready, shm_chunk(2), KVTrailer(3, 42, ((42, -0.25), (7, -1.5)))]]
    raw = wire(sent)
    assert len(raw) == 2 and flat(raw) == [m for burst in sent for m in burst]
    parts = worker_pb2.KVChunk.FromString(raw[1]).batch.parts
    assert [p.WhichOneof("part") for p in parts] == ["data", "data", "target_ready", "data", "trailer"]
    assert [from_proto(p) for p in parts] == sent[1]
    assert from_proto(worker_pb2.KVChunk(target_ready=worker_pb2.KVTargetReady(num_chunks=5, first_token_id=9))) == \
        KVTargetReady(5, 9)  # no log-probs asked


def test_bulk_chunks_go_alone_and_their_bytes_arrive_whole():
    big = bytes_chunk(0, BATCH_BYTES - 100)
    small = bytes_chunk(1, 96)
    raw = wire([[HEADER, big, small, KVTrailer(2, 1)]])
    assert len(raw) == 3  # header; the big chunk alone; the small chunk with the trailer
    got = flat(raw)
    assert [type(m) for m in got] == [KVHeader, KVData, KVData, KVTrailer]
    assert bytes(got[1].data) == bytes(big.data) and bytes(got[2].data) == bytes(small.data)
    assert got[1].crc32c == 7 and got[2].seq == 1


def test_a_source_that_fails_fails_the_stream_after_what_it_sent():
    async def source():
        yield HEADER
        raise RuntimeError("engine gone")

    async def go():
        out = []
        try:
            async for m in _Batches(source()):
                out.append(m)
        except RuntimeError as e:
            return out, str(e)
        return out, None

    out, error = asyncio.run(go())
    assert len(out) == 1 and error == "engine gone"


def test_a_malformed_batch_is_a_transfer_error_not_a_crash():
    good = worker_pb2.KVChunk(batch=worker_pb2.KVBatch(parts=[worker_pb2.KVChunk(
        trailer=worker_pb2.KVTrailer(num_chunks=0, first_token_id=1))])).SerializeToString()
    assert isinstance(decode_chunk(good), list)
    for bad in (good[:-1], good[:2] + b"\x12" + good[3:], b"\x22\x05\x0a\x09abc"):
        assert isinstance(decode_chunk(bad), TransferError)


class DecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, refuses: bool):
        self.refuses = refuses

    async def PushKV(self, request_iterator, context):
        async for _ in request_iterator:
            if self.refuses:
                await context.abort(grpc.StatusCode.DATA_LOSS, "refused")
        await asyncio.sleep(3600)


@pytest.mark.parametrize("how", ["refused", "cancelled"])
def test_a_push_that_ends_early_leaves_no_task_reading_its_source(how):
    """gRPC does not close a request iterator when the call ends early; the transport does, so
    a source that never ends (a prefill whose request went away) is not read forever."""
    async def source():
        yield HEADER
        await asyncio.sleep(3600)
        yield KVTrailer(0, 1)

    async def go():
        server = grpc.aio.server()
        add_decode_worker_servicer(DecodeWorker(refuses=how == "refused"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        transport = GrpcTransport()
        try:
            push = asyncio.ensure_future(transport.push(f"127.0.0.1:{port}", source(), 10))
            if how == "cancelled":
                await asyncio.sleep(0.2)
                push.cancel()
            done = await asyncio.gather(push, return_exceptions=True)
            await asyncio.sleep(0.3)
            left = [t.get_coro().__qualname__ for t in asyncio.all_tasks()]
            return done[0], [name for name in left if "_Batches" in name or "consume_request" in name]
        finally:
            await transport.close()
            await server.stop(0)

    outcome, left = asyncio.run(go())
    assert isinstance(outcome, TransferError if how == "refused" else asyncio.CancelledError)
    assert left == []


# ---- chunks made in their messages (the prefill side's one copy) --------------------------------
def test_a_chunk_made_in_its_message_is_the_message_a_copy_makes():
    data = np.arange(3000, dtype=np.uint16).view(np.uint8)
    wire, payload = data_chunk_in_place(5, 1, 3, 16, 6, 0xDEADBEEF, len(data))
    payload[:] = data
    made = KVData(5, 1, 3, 16, 6, memoryview(payload), 0xDEADBEEF, wire=wire)
    assert isinstance(wire, bytes) and encode_chunk(made) is wire  # sent as made: no copy
    assert wire == encode_chunk(KVData(5, 1, 3, 16, 6, data.tobytes(), 0xDEADBEEF))  # byte for byte
    got = decode_chunk(wire)
    assert (got.seq, got.group, got.layer, got.token_start, got.num_tokens, got.crc32c) == (5, 1, 3, 16, 6, 0xDEADBEEF)
    assert bytes(got.data) == data.tobytes()
    parsed = worker_pb2.KVChunk.FromString(wire).data  # protobuf's own parser agrees
    assert parsed.data == data.tobytes() and parsed.crc32c == 0xDEADBEEF and parsed.token_start == 16
    view = made.data
    del made, wire, got, parsed, payload  # a view of the data alone keeps the message alive
    import gc
    gc.collect()
    assert bytes(view) == data.tobytes()


def test_host_chunks_copy_the_slots_rows_into_checked_messages():
    """A layer's K/V by (first slot, slots) runs, split to stay under the chunk size: each chunk
    holds K of its tokens then V, as read_kv lays them out, with their CRC-32C, numbered on."""
    torch.manual_seed(0)
    layer = (torch.randn(4, 16, 2, 8), torch.randn(4, 16, 2, 8))  # [blocks, block size, kv heads, head dim]
    runs = [(3, 5), (20, 7), (40, 2)]  # 14 tokens in three runs
    slots = torch.tensor([s for start, n in runs for s in range(start, start + n)])
    per_token = 2 * 2 * 8 * 4
    chunks = host_chunks(7, 0, 1, 100, runs, *raw_layer([layer], 0), max_chunk_bytes=4 * per_token)
    assert [c.seq for c in chunks] == [7, 8, 9, 10] and [c.num_tokens for c in chunks] == [4, 4, 4, 2]
    assert [c.token_start for c in chunks] == [100, 104, 108, 112]
    for c in chunks:
        expect = read_kv([layer], 0, slots[c.token_start - 100:c.token_start - 100 + c.num_tokens])
        assert bytes(c.data) == expect.tobytes() and c.crc32c == crc32c(expect)
        assert bytes(decode_chunk(encode_chunk(c)).data) == expect.tobytes()

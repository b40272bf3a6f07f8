"""The gRPC backend of the KV transfer: `DecodeWorker.PushKV`, a client stream of `KVChunk`.

`GrpcTransport` is the prefill side (one channel per decode worker, tuned for bulk bytes);
`serve_push_kv` is the decode side, turning the PushKV call into a message stream for the
worker's `KVEndpoint` and its verdict into a status code. The conversions to and from protobuf
live here and nowhere else.

Bulk bytes skip protobuf's own copies: a data chunk is framed by hand (`encode_chunk`: the small
fields through protobuf, then the data field's tag and length, then the bytes, joined once into
the message gRPC sends) and parsed by hand on arrival (`decode_chunk`: the data field becomes a
memoryview of the received message, checksummed and written into the cache without a copy).
The wire format is exactly protobuf's `KVChunk`, so any protobuf client may still push.

Small messages ready at once travel together: `GrpcTransport.push` sends what its source has
queued as one `KVBatch` (up to `BATCH_BYTES`), since each gRPC message costs both ends about a
tenth of a millisecond of Python on this project's 2-core machine: a shared-memory push of
eight layers went from ten messages to three (header; the step's chunks and the trailer; the
ack). Bulk chunks always go alone.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
from typing import AsyncIterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from pdserve.serving.convert import logprobs_message, parse_logprobs
from pdserve.serving.grpc_server import CHANNEL_OPTIONS, KV_TRANSFER_OPTIONS
from pdserve.serving.logs import REQUEST_ID_KEY, request_id
from pdserve.serving.tracing import metadata_value, outgoing_metadata
from pdserve.engine.disagg import KVGroupLayout
from pdserve.serving.auth import ClusterSecurity
from pdserve.serving.kv_transfer import (KVAck, KVData, KVDist, KVEndpoint, KVHeader, KVMessage, KVShm, KVTargetReady,
                                         KVTrailer, TransferError, TransferFailure)
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.kv_transfer")

STATUS_OF = {
    TransferFailure.CORRUPT: grpc.StatusCode.DATA_LOSS,
    TransferFailure.MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    TransferFailure.UNKNOWN: grpc.StatusCode.NOT_FOUND,
    TransferFailure.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    TransferFailure.ABORTED: grpc.StatusCode.ABORTED,
    TransferFailure.UNREACHABLE: grpc.StatusCode.UNAVAILABLE,
    TransferFailure.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
}
FAILURE_OF = {code: failure for failure, code in STATUS_OF.items()} | {grpc.StatusCode.CANCELLED: TransferFailure.ABORTED}


def to_proto(msg: KVMessage) -> worker_pb2.KVChunk:
    if isinstance(msg, KVData):
        return worker_pb2.KVChunk(data=worker_pb2.KVData(
            seq=msg.seq, group=msg.group, layer=msg.layer, token_start=msg.token_start, num_tokens=msg.num_tokens,
            data=bytes(msg.data), crc32c=msg.crc32c, src_runs=msg.src_runs, sum64=msg.sum64))
    if isinstance(msg, KVHeader):
        header = worker_pb2.KVHeader(
            ticket=msg.ticket, num_tokens=msg.num_tokens, dtype=msg.dtype, num_cached_tokens=msg.num_cached_tokens, groups=[
                worker_pb2.KVGroupLayout(name=g.name, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                         head_dim=g.head_dim) for g in msg.groups])
        if msg.shm is not None:
            header.shm.CopyFrom(worker_pb2.KVShm(segments=msg.shm.segments, num_slots=msg.shm.num_slots))
        if msg.dist is not None:
            d = msg.dist
            header.dist.CopyFrom(worker_pb2.KVDist(host=d.host, port=d.port, name=d.name, backend=d.backend))
        return worker_pb2.KVChunk(header=header)
    if isinstance(msg, KVTargetReady):
        ready = worker_pb2.KVTargetReady(num_chunks=msg.num_chunks, first_token_id=msg.first_token_id)
        if msg.first_token_logprobs is not None:
            ready.first_token_logprobs.CopyFrom(logprobs_message(list(msg.first_token_logprobs)))
        return worker_pb2.KVChunk(target_ready=ready)
    trailer = worker_pb2.KVTrailer(num_chunks=msg.num_chunks, first_token_id=msg.first_token_id,
                                   abandoned=msg.abandoned)
    if msg.first_token_logprobs is not None:
        trailer.first_token_logprobs.CopyFrom(logprobs_message(list(msg.first_token_logprobs)))
    return worker_pb2.KVChunk(trailer=trailer)


def from_proto(chunk: worker_pb2.KVChunk) -> KVMessage:
    """One part; a batch is unpacked by `decode_chunk`, and a batch inside one is refused."""
    part = chunk.WhichOneof("part")
    if part == "data":
        d = chunk.data
        return KVData(d.seq, d.group, d.layer, d.token_start, d.num_tokens, d.data, d.crc32c, tuple(d.src_runs),
                      d.sum64)
    if part == "header":
        h = chunk.header
        shm = KVShm(tuple(h.shm.segments), h.shm.num_slots) if h.HasField("shm") else None
        dist = KVDist(h.dist.host, h.dist.port, h.dist.name, h.dist.backend) if h.HasField("dist") else None
        return KVHeader(h.ticket, h.num_tokens, h.dtype, tuple(
            KVGroupLayout(g.name, g.num_layers, g.num_kv_heads, g.head_dim) for g in h.groups), shm, dist,
            h.num_cached_tokens)
    if part == "trailer":
        t = chunk.trailer
        logprobs = (tuple(parse_logprobs(t.first_token_logprobs, t.first_token_id))
                    if t.HasField("first_token_logprobs") else None)
        return KVTrailer(t.num_chunks, t.first_token_id, logprobs, t.abandoned)
    if part == "target_ready":
        r = chunk.target_ready
        logprobs = (tuple(parse_logprobs(r.first_token_logprobs, r.first_token_id))
                    if r.HasField("first_token_logprobs") else None)
        return KVTargetReady(r.num_chunks, r.first_token_id, logprobs)
    if part == "batch":
        raise TransferError(TransferFailure.CORRUPT, "a KV batch holds another batch")
    raise TransferError(TransferFailure.CORRUPT, "a KV chunk carries no header, data or trailer")


# ---- the bulk path's framing ---------------------------------------------------------------------
_DATA_PART = 0x12  # KVChunk field 2 (data), length-delimited
_DATA_FIELD = 0x32  # KVData field 6 (data), length-delimited
_BATCH_PART = 0x22  # KVChunk field 4 (batch), length-delimited
_BATCH_ITEM = 0x0A  # KVBatch field 1 (parts), length-delimited
BATCH_BYTES = 64 << 10  # a message this large or larger goes alone; a batch stays about this size


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_chunk(msg: KVMessage) -> bytes:
    """A message's `KVChunk` wire bytes; a data chunk's bytes are copied once, into the result,
    unless the chunk was made in its message already (`data_chunk_in_place`)."""
    if isinstance(msg, KVData) and msg.wire is not None:
        return msg.wire
    if not isinstance(msg, KVData) or not len(msg.data):
        return to_proto(msg).SerializeToString()
    head = _data_head(msg.seq, msg.group, msg.layer, msg.token_start, msg.num_tokens, msg.crc32c, len(msg.data))
    return b"".join((head, msg.data))


def _data_head(seq: int, group: int, layer: int, token_start: int, num_tokens: int, crc: int, n: int) -> bytes:
    """A data chunk's `KVChunk` bytes before its n data bytes."""
    meta = worker_pb2.KVData(seq=seq, group=group, layer=layer, token_start=token_start, num_tokens=num_tokens,
                             crc32c=crc).SerializeToString()
    field_head = bytes([_DATA_FIELD]) + _varint(n)
    return b"".join((bytes([_DATA_PART]), _varint(len(meta) + len(field_head) + n), meta, field_head))


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize  # (NULL, n): n bytes to fill before use
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)


def data_chunk_in_place(seq: int, group: int, layer: int, token_start: int, num_tokens: int, crc: int,
                        num_bytes: int) -> tuple[bytes, np.ndarray]:
    """A data chunk's `KVChunk` message made at its final size with its data not yet written, and
    a writable uint8 array over the data field: the sender copies the K/V out of its cache
    straight into the message gRPC sends (`encode_chunk` returns it as is), where building the
    chunk first and framing it after copied every byte twice. The checksum goes before the data
    on the wire, so it is computed first, where the K/V lie. The message is a new bytes object
    that nothing else has seen: it is filled here and by the caller, then only read."""
    head = _data_head(seq, group, layer, token_start, num_tokens, crc, num_bytes)
    wire = _new_bytes(None, len(head) + num_bytes)
    raw = (ctypes.c_uint8 * len(wire)).from_address(ctypes.cast(ctypes.c_char_p(wire), ctypes.c_void_p).value)
    raw.message = wire  # every view of the buffer keeps the message alive
    buf = np.ctypeslib.as_array(raw)
    buf[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    return wire, buf[len(head):]


def encode_batch(encoded: list[bytes]) -> bytes:
    """`KVChunk`s' wire bytes (from `encode_chunk`) as one `KVChunk` holding a `KVBatch`."""
    items = b"".join(b"".join((bytes([_BATCH_ITEM]), _varint(len(e)), e)) for e in encoded)
    return b"".join((bytes([_BATCH_PART]), _varint(len(items)), items))


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("a varint runs past the message")
        b = buf[i]
        n |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return n, i


def decode_chunk(raw: bytes) -> KVMessage | list[KVMessage] | TransferError:
    """A received `KVChunk`: data chunks parsed here with their bytes as a memoryview of `raw`
    (no copy), headers and trailers through protobuf, a batch as the list of its parts.
    A chunk that does not parse becomes the TransferError to raise in its place (a deserializer
    that raised would end the call with INTERNAL, not DATA_LOSS)."""
    buf = memoryview(raw)
    try:
        if len(buf) and buf[0] == _BATCH_PART:
            return [_decode_part(part) for part in _batch_parts(buf)]
        return _decode_part(buf)
    except TransferError as e:
        return e
    except (ValueError, DecodeError) as e:
        return TransferError(TransferFailure.CORRUPT, f"a KV chunk does not parse: {e}")


def _decode_part(buf: memoryview) -> KVMessage:
    if not len(buf) or buf[0] != _DATA_PART:
        return from_proto(worker_pb2.KVChunk.FromString(buf))
    size, i = _read_varint(buf, 1)
    if i + size != len(buf):
        raise ValueError("a KV chunk's data part does not fill the message")
    return _decode_data(buf, i)


def _batch_parts(buf: memoryview) -> list[memoryview]:
    size, i = _read_varint(buf, 1)
    if i + size != len(buf):
        raise ValueError("a KV batch does not fill the message")
    parts = []
    while i < len(buf):
        if buf[i] != _BATCH_ITEM:
            raise ValueError(f"a KV batch holds field tag {buf[i]:#x}, not a part")
        n, i = _read_varint(buf, i + 1)
        if i + n > len(buf):
            raise ValueError("a KV batch's part runs past the message")
        parts.append(buf[i:i + n])
        i += n
    return parts


def _decode_data(buf: memoryview, i: int) -> KVData:
    ints = dict.fromkeys((1, 2, 3, 4, 5, 7, 9), 0)
    data, runs = buf[0:0], []
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
            if number == 8:
                runs.append(value)
            else:
                ints[number] = value
        elif wire == 2:
            n, i = _read_varint(buf, i)
            if i + n > len(buf):
                raise ValueError("a field runs past the message")
            if number == 6:
                data = buf[i:i + n]
            elif number == 8:  # packed src_runs
                j = i
                while j < i + n:
                    value, j = _read_varint(buf, j)
                    runs.append(value)
            i += n
        elif wire == 5:
            i += 4
        elif wire == 1:
            i += 8
        else:
            raise ValueError(f"wire type {wire} in field {number}")
    return KVData(ints[1], ints[2], ints[3], ints[4], ints[5], data, ints[7], tuple(runs), ints[9])


def add_decode_worker_servicer(servicer, server) -> None:
    """`add_DecodeWorkerServicer_to_server`, with PushKV's chunks framed by `decode_chunk` (the
    handler then receives `KVMessage`s) instead of protobuf's parser."""
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, _FastPushKV(server))


class _FastPushKV:
    """Stands in for the server while the generated code registers its handlers."""

    def __init__(self, server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # rebuilt from the patched table below

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        push = handlers["PushKV"]
        handlers = handlers | {"PushKV": grpc.stream_unary_rpc_method_handler(
            push.stream_unary, request_deserializer=decode_chunk, response_serializer=push.response_serializer)}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)


class GrpcTransport:
    def __init__(self, security: ClusterSecurity = ClusterSecurity(), channel_options: list[tuple] = ()):
        self.security = security
        self._options = [*CHANNEL_OPTIONS, *KV_TRANSFER_OPTIONS, *channel_options]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.security.channel(address, self._options)
        return self._channels[address]

    async def decode_info(self, address: str, timeout_s: float, purpose: str) -> worker_pb2.WorkerInfo | None:
        """The decode worker's WorkerInfo (a probe of what it takes), or None, logged, when it
        does not answer: the caller then pushes over gRPC alone."""
        stub = worker_pb2_grpc.DecodeWorkerStub(self.channel(address))
        try:
            return await stub.GetInfo(worker_pb2.InfoRequest(), timeout=timeout_s, metadata=self.security.metadata)
        except grpc.aio.AioRpcError as e:
            log.warning("%s probe of %s: GetInfo failed (%s); pushing K/V over gRPC", purpose, address, e.code().name)
            return None

    async def push(self, address: str, messages: AsyncIterator[KVMessage], timeout_s: float) -> KVAck:
        push_kv = self.channel(address).stream_unary(
            "/pdserve.v1.DecodeWorker/PushKV", request_serializer=bytes,
            response_deserializer=worker_pb2.PushKVResponse.FromString)
        # the cluster's credentials, and the request's id and trace context for the decode side's logs
        batches = _Batches(messages)
        call = push_kv(batches, timeout=timeout_s, metadata=(*self.security.metadata, *outgoing_metadata()))
        try:
            ack = await call
        except grpc.aio.AioRpcError as e:
            failure = FAILURE_OF.get(e.code(), TransferFailure.UNREACHABLE)
            raise TransferError(failure, f"KV push to {address}: {e.code().name}: {e.details()}") from None
        finally:
            call.cancel()  # a no-op once it ended; stops the stream when we are cancelled
            batches.close()
        return KVAck(ack.num_chunks, ack.num_bytes)

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels.values()), return_exceptions=True)


_DONE = object()


class _Batches:
    """The messages' wire bytes, as gRPC's request iterator: each gRPC message holds what
    `messages` had ready at once (a `KVBatch` of up to `BATCH_BYTES`; a bulk chunk alone). A task
    reads `messages` as they come, so waiting for the next one never holds back those already
    here; each is encoded only when its turn to be sent comes (a bulk chunk's copy into its
    message then overlaps the sending of the one before). `close` ends it at once, whatever
    `messages` does: gRPC does not close a request iterator when the call ends early."""

    def __init__(self, messages: AsyncIterator[KVMessage]):
        self._ready: collections.deque = collections.deque()  # messages, then _DONE or the source's exception
        self._arrived = asyncio.Event()
        self._task = asyncio.ensure_future(self._pump(messages))

    async def _pump(self, messages: AsyncIterator[KVMessage]) -> None:
        try:
            async for msg in messages:
                self._ready.append(msg)
                self._arrived.set()
        except Exception as e:  # noqa: BLE001 - raised where the stream reads it
            self._ready.append(e)
        else:
            self._ready.append(_DONE)
        self._arrived.set()

    def __aiter__(self) -> "_Batches":
        return self

    async def __anext__(self) -> bytes:
        while not self._ready:
            self._arrived.clear()
            await self._arrived.wait()
        item = self._ready.popleft()
        if item is _DONE:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        batch, size = [item], _wire_size(item)
        while self._ready and isinstance(self._ready[0], KVData | KVHeader | KVTargetReady | KVTrailer) \
                and size + _wire_size(self._ready[0]) <= BATCH_BYTES:
            batch.append(self._ready.popleft())
            size += _wire_size(batch[-1])
        return encode_chunk(item) if len(batch) == 1 else encode_batch([encode_chunk(m) for m in batch])

    def close(self) -> None:
        """Stop reading the source (its generator ends there); a stream still being read fails,
        which makes gRPC cancel the call: ending it cleanly instead would half-close it, and the
        decode side would see a transfer truncated, not a push cancelled."""
        self._task.cancel()
        self._ready.clear()
        self._ready.append(_Closed("the KV push ended"))
        self._arrived.set()


class _Closed(Exception):
    pass


def _wire_size(msg: KVMessage) -> int:
    """About a message's encoded size: its bulk bytes, and a bound on the rest."""
    if isinstance(msg, KVData):
        return len(msg.data) + 64 + 6 * len(msg.src_runs)
    return 1024


async def serve_push_kv(endpoint: KVEndpoint, request_iterator, context) -> worker_pb2.PushKVResponse:
    """The body of a decode worker's PushKV handler (registered by `add_decode_worker_servicer`)."""

    async def messages():
        async for msg in request_iterator:  # decode_chunk made them KVMessages (a list: a batch)
            if isinstance(msg, TransferError):
                raise msg
            if isinstance(msg, list):
                for part in msg:
                    yield part
            else:
                yield msg

    request_id.set(metadata_value(context.invocation_metadata(), REQUEST_ID_KEY))

    try:
        ack = await endpoint.receive_kv(messages())
    except TransferError as e:
        await context.abort(STATUS_OF[e.failure], str(e))
    return worker_pb2.PushKVResponse(num_chunks=ack.num_chunks, num_bytes=ack.num_bytes)

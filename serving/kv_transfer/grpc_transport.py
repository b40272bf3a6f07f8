"""The gRPC backend of the KV transfer: `DecodeWorker.PushKV`, a client stream of `KVChunk`.

`GrpcTransport` is the prefill side (one channel per decode worker, tuned for bulk bytes);
`serve_push_kv` is the decode side, turning the PushKV call into a message stream for the
worker's `KVEndpoint` and its verdict into a status code. The conversions to and from protobuf
live here and nowhere else.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from pdserve.serving.grpc_server import CHANNEL_OPTIONS, KV_TRANSFER_OPTIONS
from pdserve.engine.disagg import KVGroupLayout
from pdserve.serving.auth import ClusterSecurity
from pdserve.serving.kv_transfer import (KVAck, KVData, KVEndpoint, KVHeader, KVMessage, KVTrailer, TransferError,
                                         TransferFailure)
from pdserve.v1 import worker_pb2, worker_pb2_grpc

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
            data=msg.data, crc32=msg.crc32))
    if isinstance(msg, KVHeader):
        return worker_pb2.KVChunk(header=worker_pb2.KVHeader(
            ticket=msg.ticket, num_tokens=msg.num_tokens, dtype=msg.dtype, groups=[
                worker_pb2.KVGroupLayout(name=g.name, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                         head_dim=g.head_dim) for g in msg.groups]))
    return worker_pb2.KVChunk(trailer=worker_pb2.KVTrailer(num_chunks=msg.num_chunks,
                                                           first_token_id=msg.first_token_id))


def from_proto(chunk: worker_pb2.KVChunk) -> KVMessage:
    part = chunk.WhichOneof("part")
    if part == "data":
        d = chunk.data
        return KVData(d.seq, d.group, d.layer, d.token_start, d.num_tokens, d.data, d.crc32)
    if part == "header":
        h = chunk.header
        return KVHeader(h.ticket, h.num_tokens, h.dtype, tuple(
            KVGroupLayout(g.name, g.num_layers, g.num_kv_heads, g.head_dim) for g in h.groups))
    if part == "trailer":
        return KVTrailer(chunk.trailer.num_chunks, chunk.trailer.first_token_id)
    raise TransferError(TransferFailure.CORRUPT, "a KV chunk carries no header, data or trailer")


class GrpcTransport:
    def __init__(self, security: ClusterSecurity = ClusterSecurity(), channel_options: list[tuple] = ()):
        self._security = security
        self._options = [*CHANNEL_OPTIONS, *KV_TRANSFER_OPTIONS, *channel_options]
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        if address not in self._channels:
            self._channels[address] = self._security.channel(address, self._options)
        return worker_pb2_grpc.DecodeWorkerStub(self._channels[address])

    async def push(self, address: str, messages: AsyncIterator[KVMessage], timeout_s: float) -> KVAck:
        async def chunks():
            async for msg in messages:
                yield to_proto(msg)

        call = self._stub(address).PushKV(chunks(), timeout=timeout_s, metadata=self._security.metadata)
        try:
            ack = await call
        except grpc.aio.AioRpcError as e:
            failure = FAILURE_OF.get(e.code(), TransferFailure.UNREACHABLE)
            raise TransferError(failure, f"KV push to {address}: {e.code().name}: {e.details()}") from None
        finally:
            call.cancel()  # a no-op once it ended; stops the stream when we are cancelled
        return KVAck(ack.num_chunks, ack.num_bytes)

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self._channels.values()), return_exceptions=True)


async def serve_push_kv(endpoint: KVEndpoint, request_iterator, context) -> worker_pb2.PushKVResponse:
    """The body of a decode worker's PushKV handler."""

    async def messages():
        async for chunk in request_iterator:
            yield from_proto(chunk)

    try:
        ack = await endpoint.receive_kv(messages())
    except TransferError as e:
        await context.abort(STATUS_OF[e.failure], str(e))
    return worker_pb2.PushKVResponse(num_chunks=ack.num_chunks, num_bytes=ack.num_bytes)

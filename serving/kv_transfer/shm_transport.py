"""`ShmTransport`: the KV push for a prefill worker whose KV cache lives in shared memory
(`shm.KVArena`). gRPC still carries every message (header, numbered and checksummed chunks,
trailer, ack); what differs is where the bulk bytes go:

- a decode worker on the same node (this process can open its probe and read its nonce,
  learned once per address from GetInfo): the header names our segments and each data chunk
  names the slots that hold its tokens; the decode side copies them itself.
- any other decode worker: each chunk's bytes are read out of our cache here and the stream is
  plain gRPC, the same as `GrpcTransport` alone.

The slots stay ours and unchanged until the push returns: the prefill worker releases a
request's blocks only after its push ended (acked, failed or cancelled).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import AsyncIterator

import numpy as np

from pdserve.serving.kv_transfer import KVAck, KVData, KVHeader, KVMessage, KVShm, TransferError
from pdserve.serving.kv_transfer.grpc_transport import GrpcTransport
from pdserve.serving.kv_transfer.shm import KVArena, can_open_probe, parse_runs

log = logging.getLogger("pdserve.kv_shm")


class ShmTransport:
    def __init__(self, arena: KVArena, grpc_transport: GrpcTransport, raw_layers, probe_timeout_s: float = 5.0):
        """raw_layers(group, layer) -> (K, V): raw [num_slots, num_kv_heads, head_dim] views of
        our cache, for the peers that need the bytes themselves."""
        self.arena = arena
        self.grpc = grpc_transport
        self.raw_layers = raw_layers
        self.probe_timeout_s = probe_timeout_s
        self._same_node: dict[str, bool] = {}  # decode address -> whether it shares our /dev/shm
        self.num_shm_pushes = 0

    async def push(self, address: str, messages: AsyncIterator[KVMessage], timeout_s: float) -> KVAck:
        use_shm = bool(self.arena.segments) and await self.is_same_node(address)
        stream = self._by_reference(messages) if use_shm else self._by_value(messages)
        try:
            ack = await self.grpc.push(address, stream, timeout_s)
        except TransferError:
            self._same_node.pop(address, None)  # ask again next time: it may have restarted elsewhere
            raise
        self.num_shm_pushes += use_shm
        return ack

    async def is_same_node(self, address: str) -> bool:
        if address not in self._same_node:
            info = await self.grpc.decode_info(address, self.probe_timeout_s, "shared-memory")
            if info is None:
                return False
            self._same_node[address] = await asyncio.to_thread(can_open_probe, info.shm_probe, info.shm_probe_nonce)
            log.info("KV to %s goes over %s", address, "shared memory" if self._same_node[address] else "gRPC")
        return self._same_node[address]

    async def _by_reference(self, messages: AsyncIterator[KVMessage]):
        shm = KVShm(self.arena.names, self.arena.num_slots)
        async for msg in messages:
            yield dataclasses.replace(msg, shm=shm) if isinstance(msg, KVHeader) else msg

    async def _by_value(self, messages: AsyncIterator[KVMessage]):
        async for msg in messages:
            if isinstance(msg, KVData) and msg.src_runs:
                msg = dataclasses.replace(msg, data=self._read(msg), src_runs=())
            yield msg

    def _read(self, d: KVData) -> bytes:
        """The chunk's K then V bytes, out of our cache (the layout a bytes chunk carries)."""
        k, v = self.raw_layers(d.group, d.layer)
        runs = parse_runs(d.src_runs, len(k), d.num_tokens)
        return np.concatenate([cache[s:s + n] for cache in (k, v) for s, n in runs]).tobytes()

    async def close(self) -> None:
        await self.grpc.close()

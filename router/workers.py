"""The router's view of its workers: connections, reported info and stats, health, pairing,
and the selection policies.

A worker is `healthy` while its grpc.health.v1 check says SERVING; a failed check (or a call
that finds it UNAVAILABLE) takes it out of selection until a later check passes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.serving.grpc_server import CHANNEL_OPTIONS

log = logging.getLogger("pdserve.router")

# What must agree between a prefill and a decode worker for the KV of one to serve the other.
PAIRING_FIELDS = ("model_identity", "dtype", "block_size", "kv_layout", "kv_groups", "draft_identity")


@dataclass(slots=True, eq=False)
class Worker:
    address: str
    role: str  # "prefill" or "decode"
    stub: object
    health: health_pb2_grpc.HealthStub
    info: worker_pb2.WorkerInfo | None = None
    stats: worker_pb2.WorkerStats = field(default_factory=worker_pb2.WorkerStats)
    healthy: bool = False
    num_queued_prompt_tokens: int = 0  # sent by this router and not yet answered (prefill)


def pairing_differences(prefill: worker_pb2.WorkerInfo, decode: worker_pb2.WorkerInfo) -> list[str]:
    """What differs between two workers' KV-relevant descriptions, as readable lines."""
    diffs = []
    for name in PAIRING_FIELDS:
        a, b = getattr(prefill, name), getattr(decode, name)
        if name == "kv_groups":
            a, b = [_group(g) for g in a], [_group(g) for g in b]
        if a != b:
            diffs.append(f"{name}: prefill has {a!r}, decode has {b!r}")
    return diffs


def _group(g: worker_pb2.KVGroupLayout) -> str:
    return f"{g.name}(layers={g.num_layers}, kv_heads={g.num_kv_heads}, head_dim={g.head_dim})"


class Policy(Protocol):
    def order(self, workers: list[Worker]) -> list[Worker]:
        """Candidates best first."""


class FewestQueuedPromptTokens:
    """Prefill: the worker with the least prompt work ahead of a new request."""

    def order(self, workers: list[Worker]) -> list[Worker]:
        return sorted(workers, key=lambda w: w.num_queued_prompt_tokens + w.stats.num_queued_prompt_tokens)


class MostFreeBlocks:
    """Decode: the worker with the most free KV blocks."""

    def order(self, workers: list[Worker]) -> list[Worker]:
        return sorted(workers, key=lambda w: -w.stats.num_free_blocks)


class WorkerPool:
    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str], rpc_timeout_s: float,
                 prefill_policy: Policy | None = None, decode_policy: Policy | None = None):
        self.prefill = [self._connect(a, "prefill") for a in prefill_addresses]
        self.decode = [self._connect(a, "decode") for a in decode_addresses]
        self.rpc_timeout_s = rpc_timeout_s
        self.prefill_policy = prefill_policy or FewestQueuedPromptTokens()
        self.decode_policy = decode_policy or MostFreeBlocks()
        self._pairs: set[tuple[str, str]] = set()

    @staticmethod
    def _connect(address: str, role: str) -> Worker:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
        return Worker(address, role, stub, health_pb2_grpc.HealthStub(channel))

    @property
    def is_colocated(self) -> bool:
        return not self.prefill

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    async def connect(self, timeout_s: float) -> None:
        """Wait until every worker is SERVING and has said what it runs; then check pairing.
        ValueError names what is unreachable or what differs."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.workers)
        while pending:
            await asyncio.gather(*(self.check(w) for w in pending))
            pending = [w for w in pending if w.info is None]
            if pending and time.monotonic() > deadline:
                raise ValueError(f"workers not serving after {timeout_s:g} s: {[w.address for w in pending]}")
            if pending:
                await asyncio.sleep(0.2)
        self._check_pairing()

    def _check_pairing(self) -> None:
        problems = []
        for p in self.prefill:
            for d in self.decode:
                diffs = pairing_differences(p.info, d.info)
                if diffs:
                    problems.append(f"prefill {p.address} and decode {d.address} differ: " + "; ".join(diffs))
                else:
                    self._pairs.add((p.address, d.address))
        for w in self.workers:
            partners = [b for a, b in self._pairs if a == w.address] + [a for a, b in self._pairs if b == w.address]
            if self.prefill and not partners:
                raise ValueError("refusing mismatched workers: " + " | ".join(problems))
        for line in problems:
            log.warning("not pairing: %s", line)

    def paired(self, prefill: Worker, decode: Worker) -> bool:
        return (prefill.address, decode.address) in self._pairs

    async def check(self, w: Worker, timeout_s: float = 2.0) -> None:
        try:
            resp = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            serving = resp.status == health_pb2.HealthCheckResponse.SERVING
            if serving and w.info is None:
                w.info = await w.stub.GetInfo(worker_pb2.InfoRequest(), timeout=timeout_s)
            if serving:
                w.stats = await w.stub.GetStats(worker_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            serving = False
        if serving != w.healthy:
            level = logging.INFO if serving else logging.WARNING
            log.log(level, "worker %s %s is now %s", w.role, w.address, "healthy" if serving else "UNHEALTHY")
        w.healthy = serving

    async def watch(self, interval_s: float) -> None:
        """Health-check and refresh stats forever."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.gather(*(self.check(w) for w in self.workers))

    def decode_candidates(self) -> list[Worker]:
        return self.decode_policy.order([w for w in self.decode if w.healthy])

    def prefill_candidates(self, decode: Worker) -> list[Worker]:
        return self.prefill_policy.order([w for w in self.prefill if w.healthy and self.paired(w, decode)])

    def limits(self) -> tuple[int, int]:
        """(max_model_len, vocab_size) every decode worker accepts."""
        infos = [w.info for w in self.decode]
        return min(i.max_model_len for i in infos), min(i.vocab_size for i in infos)

"""The router's view of its workers: membership, connections, what each runs, health, pairing,
and the load the router itself has put on each.

Membership is static (the standalone router's `--prefill`/`--decode` addresses) or follows the
cluster (`add` / `remove` as workers register, restart elsewhere, or are drained). A worker is
*healthy* while its grpc.health.v1 check says SERVING; a check that fails (NOT_SERVING, the
connection refused), or a call that finds it UNAVAILABLE, takes it out of selection until a later
check passes. A check that only times out counts as failed once `MAX_SLOW_CHECKS` do in a row:
a worker too busy to answer within the check's timeout (a CPU-starved host) is not a dead one,
and taking it out would fail requests it can serve. Nor does a GetStats that fails inside a worker
whose health check says SERVING (`STATS_BUGS`): it keeps serving on the last load it reported.
A worker that comes back
is asked again what it runs, since it may have restarted with another configuration. A prefill
and a decode worker are used together only if their KV-relevant descriptions agree (`PAIRING_FIELDS`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.prefix_index import PrefixIndex
from pdserve.serving.auth import ClusterSecurity
from pdserve.serving.grpc_server import CHANNEL_OPTIONS
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.router")

# A decode worker whose cache probably holds the prompt's start is picked over the least loaded
# while its load (the share of its sequence slots taken) is at most this much higher.
AFFINITY_SLACK = 0.25
# Health checks in a row that may time out before a healthy worker is taken out of selection.
MAX_SLOW_CHECKS = 3
# GetStats errors raised inside a worker that answered (not a connection or a deadline): they do
# not take a worker that says SERVING out of selection.
STATS_BUGS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# What must agree between a prefill and a decode worker for the KV of one to serve the other.
PAIRING_FIELDS = ("model_identity", "dtype", "kv_dtype", "block_size", "kv_layout", "kv_groups", "draft_identity")
# Router -> worker channels: notice a silent peer within ~15 s, and retry a lost connection at
# least every second (gRPC's default backoff grows to two minutes, which kept a returning
# worker idle long after it was back).
WORKER_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(slots=True, eq=False)
class Worker:
    worker_id: str
    role: str  # "prefill" or "decode"
    address: str
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    info: worker_pb2.WorkerInfo | None = None
    stats: worker_pb2.WorkerStats = field(default_factory=worker_pb2.WorkerStats)
    healthy: bool = False
    num_slow_checks: int = 0  # health checks in a row that timed out
    stats_failing: bool = False  # SERVING, but its GetStats fails (kept in service on stale stats)
    boot_id: str = ""  # of the process last seen at this address: a new one may run another configuration
    is_removed: bool = False
    num_in_flight: int = 0  # requests this router sent here that have not ended
    num_queued_prompt_tokens: int = 0  # prefill: prompt tokens sent here and not yet answered
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # what its prefix cache probably holds

    @property
    def load(self) -> float:
        """Decode: the share of its sequence slots the router's requests take, counting ones sent
        but not yet answered (so a burst spreads before any stats arrive)."""
        return self.num_in_flight / max(self.stats.max_num_seqs or 1, 1)


def pairing_differences(prefill: worker_pb2.WorkerInfo, decode: worker_pb2.WorkerInfo) -> list[str]:
    """What differs between two workers' KV-relevant descriptions, as readable lines."""
    diffs = []
    for name in PAIRING_FIELDS:
        a, b = getattr(prefill, name), getattr(decode, name)
        if name == "kv_dtype":  # a worker from before the field: its cache has its model's dtype
            a, b = a or prefill.dtype, b or decode.dtype
        if name == "kv_groups":
            a, b = [_group(g) for g in a], [_group(g) for g in b]
        if a != b:
            diffs.append(f"{name}: prefill has {a!r}, decode has {b!r}")
    return diffs


def _group(g: worker_pb2.KVGroupLayout) -> str:
    return f"{g.name}(layers={g.num_layers}, kv_heads={g.num_kv_heads}, head_dim={g.head_dim})"


class WorkerPool:
    def __init__(self, is_disaggregated: bool, security: ClusterSecurity = ClusterSecurity(),
                 check_timeout_s: float = 2.0):
        self.is_disaggregated = is_disaggregated
        self.prefill_fallback = True  # see prefill_down
        self.security = security  # every call to a worker carries the cluster's credentials
        self.check_timeout_s = check_timeout_s
        self.workers: dict[str, Worker] = {}
        self._mismatch_logged: set[tuple[str, str]] = set()
        self._joined = asyncio.Event()  # a worker joined since the last round of health checks

    @classmethod
    def static(cls, prefill_addresses: list[str], decode_addresses: list[str],
               security: ClusterSecurity = ClusterSecurity()) -> WorkerPool:
        """The standalone router's pool: fixed addresses, each its own worker id."""
        pool = cls(is_disaggregated=bool(prefill_addresses), security=security)
        for role, addresses in (("prefill", prefill_addresses), ("decode", decode_addresses)):
            for address in addresses:
                pool.add(address, role, address)
        return pool

    @property
    def is_colocated(self) -> bool:
        return not self.is_disaggregated

    # ---- membership ----------------------------------------------------------------------
    def add(self, worker_id: str, role: str, address: str) -> Worker:
        """A worker joins (or rejoins at a new address); it is selectable once healthy and paired."""
        old = self.workers.get(worker_id)
        if old is not None and old.address == address:
            return old
        if old is not None:
            self.remove(worker_id)
        channel = self.security.channel(address, WORKER_CHANNEL_OPTIONS)
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
        w = Worker(worker_id, role, address, channel, stub, health_pb2_grpc.HealthStub(channel))
        self.workers[worker_id] = w
        self._joined.set()
        log.info("worker %s %s joined at %s", role, worker_id, address)
        return w

    def remove(self, worker_id: str) -> None:
        """Stop selecting a worker; calls already running on it go on until they end."""
        w = self.workers.pop(worker_id, None)
        if w is not None:
            w.is_removed, w.healthy = True, False
            log.info("worker %s %s at %s left", w.role, worker_id, w.address)
            asyncio.get_running_loop().call_later(300, lambda: asyncio.ensure_future(w.channel.close()))

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    # ---- health --------------------------------------------------------------------------
    async def check(self, w: Worker) -> None:
        """One health check; a worker that is (again) SERVING, or a new process at the same
        address, is asked what it runs (and re-checked against the pairing rules)."""
        md, timeout = self.security.metadata, self.check_timeout_s
        why = "it reports NOT_SERVING"
        try:
            resp = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            serving = resp.status == health_pb2.HealthCheckResponse.SERVING
            if serving:
                try:
                    stats = await w.stub.GetStats(worker_pb2.StatsRequest(), timeout=timeout, metadata=md)
                except grpc.aio.AioRpcError as e:
                    if e.code() in STATS_BUGS and w.healthy and w.info is not None:
                        self._stats_failing(w, e)
                        return
                    raise
                if w.stats_failing:
                    log.info("worker %s %s at %s answers GetStats again", w.role, w.worker_id, w.address)
                    w.stats_failing = False
                if w.info is None or not w.healthy or stats.boot_id != w.boot_id:
                    w.info = await w.stub.GetInfo(worker_pb2.InfoRequest(), timeout=timeout, metadata=md)
                w.stats, w.boot_id = stats, stats.boot_id
        except grpc.aio.AioRpcError as e:
            serving, why = False, f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                w.num_slow_checks += 1
                if w.healthy and w.num_slow_checks < MAX_SLOW_CHECKS:
                    return  # busy, not gone: still healthy
            else:
                w.num_slow_checks = 0
        else:
            w.num_slow_checks = 0
        if serving != w.healthy and not w.is_removed:
            level = logging.INFO if serving else logging.WARNING
            log.log(level, "worker %s %s at %s is now %s", w.role, w.worker_id, w.address,
                    "healthy" if serving else f"UNHEALTHY ({why})")
        w.healthy = serving and not w.is_removed

    @staticmethod
    def _stats_failing(w: Worker, e: grpc.aio.AioRpcError) -> None:
        """SERVING, but GetStats failed inside the worker: a fault in its statistics, not in what
        it serves. It stays in selection on the last load it reported (taking it out turned one
        stats bug into refused requests: BENCHMARKS.md, soak)."""
        w.num_slow_checks = 0
        if not w.stats_failing:
            log.warning("worker %s %s at %s: GetStats failed (%s: %s); kept in service, its health check "
                        "says SERVING", w.role, w.worker_id, w.address, e.code().name, e.details())
        w.stats_failing = True

    def mark_unavailable(self, w: Worker) -> None:
        """A call found the worker unreachable: no traffic until a health check passes."""
        if w.healthy:
            log.warning("worker %s %s at %s is unreachable", w.role, w.worker_id, w.address)
        w.healthy = False

    async def watch(self, interval_s: float) -> None:
        """Health-check every worker every `interval_s`, whatever the length of an outage, and
        at once when a worker joins: a worker registers once it serves, and the wait for the
        next round could keep a restarted or added one out of traffic that long
        (`benchmarks/recovery.py` did not see the difference beyond its noise: BENCHMARKS.md,
        Recovery)."""
        while True:
            self._joined.clear()
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))
            try:
                await asyncio.wait_for(self._joined.wait(), interval_s)
            except asyncio.TimeoutError:
                pass

    async def connect(self, timeout_s: float) -> None:
        """Static pools: wait until every worker is SERVING and has said what it runs, then check
        that they pair. ValueError names what is unreachable or what differs."""
        deadline = time.monotonic() + timeout_s
        while pending := [w for w in self.workers.values() if w.info is None or not w.healthy]:
            await asyncio.gather(*(self.check(w) for w in pending))
            if [w for w in pending if w.info is None or not w.healthy] and time.monotonic() > deadline:
                raise ValueError(f"workers not serving after {timeout_s:g} s: {[w.address for w in pending]}")
            await asyncio.sleep(0.1)
        if self.is_disaggregated:
            problems = [f"prefill {p.address} and decode {d.address} differ: " + "; ".join(diffs)
                        for p in self.of_role("prefill") for d in self.of_role("decode")
                        if (diffs := pairing_differences(p.info, d.info))]
            unpaired = [w.address for w in self.workers.values() if not self._partners(w)]
            if unpaired:
                raise ValueError("refusing mismatched workers: " + " | ".join(problems))

    # ---- selection -----------------------------------------------------------------------
    def paired(self, prefill: Worker, decode: Worker) -> bool:
        if prefill.info is None or decode.info is None:
            return False
        diffs = pairing_differences(prefill.info, decode.info)
        key = (prefill.worker_id + prefill.info.model_identity, decode.worker_id + decode.info.model_identity)
        if diffs and key not in self._mismatch_logged:
            self._mismatch_logged.add(key)
            log.warning("not pairing prefill %s with decode %s: %s", prefill.address, decode.address, "; ".join(diffs))
        return not diffs

    def _partners(self, w: Worker) -> list[Worker]:
        other = "decode" if w.role == "prefill" else "prefill"
        return [o for o in self.of_role(other) if (self.paired(w, o) if w.role == "prefill" else self.paired(o, w))]

    def decode_candidates(self, prompt_ids: list[int] = ()) -> list[Worker]:
        """Healthy decode workers that can be used now, least loaded first; but first, of those
        loaded at most AFFINITY_SLACK more than the least, the one whose prefix cache probably
        holds the longest prefix of `prompt_ids` (a conversation's earlier turn, decoded there:
        its reservation adopts those blocks, so no transfer moves them again, and colocated, no
        prefill computes them again)."""
        ws = [w for w in self.of_role("decode") if w.healthy and w.info is not None]
        if self.is_disaggregated and not self.prefill_down():
            ws = [w for w in ws if any(p.healthy and self.paired(p, w) for p in self.of_role("prefill"))]
        ws.sort(key=lambda w: (w.load, -w.stats.num_free_blocks))
        if prompt_ids and len(ws) > 1:
            near = [w for w in ws if w.load <= ws[0].load + AFFINITY_SLACK]
            cached = [w.prefixes.match(prompt_ids, w.info.block_size) for w in near]
            best = max(range(len(near)), key=lambda i: (cached[i], -i))
            if cached[best]:
                ws.insert(0, ws.pop(ws.index(near[best])))
        return ws

    def prefill_down(self) -> bool:
        """Disaggregated, and not one prefill worker is healthy (all dead or restarting): the decode
        workers then prefill for themselves, colocated, until one is back. Healthy prefill workers
        that pair with no decode worker are a configuration error, never papered over this way."""
        return self.is_disaggregated and self.prefill_fallback and not any(p.healthy for p in self.of_role("prefill"))

    def prefill_candidates(self, decode: Worker, prompt_ids: list[int]) -> list[Worker]:
        """Healthy prefill workers that pair with `decode`, cheapest first: the prompt tokens
        queued there plus this prompt's tokens beyond the prefix it probably has cached."""
        ws = [w for w in self.of_role("prefill") if w.healthy and self.paired(w, decode)]
        return sorted(ws, key=lambda w: self.prefill_cost(w, prompt_ids))

    @staticmethod
    def prefill_cost(w: Worker, prompt_ids: list[int]) -> int:
        cached = w.prefixes.match(prompt_ids, w.info.block_size) if w.info else 0
        queued = max(w.num_queued_prompt_tokens, w.stats.num_queued_prompt_tokens)
        return queued + len(prompt_ids) - cached

    def missing(self) -> str | None:
        """Why no request can be served now (the pool that has no usable worker), or None."""
        if not self.decode_candidates():
            if self.is_disaggregated and self.of_role("decode") and any(w.healthy for w in self.of_role("decode")):
                return "no healthy prefill worker pairs with a healthy decode worker"
            return "no healthy decode worker"
        return None

    def limits(self) -> tuple[int, int] | None:
        """(max_model_len, vocab_size) every known decode worker accepts; None before any reported."""
        infos = [w.info for w in self.of_role("decode") if w.info is not None]
        if not infos:
            return None
        return min(i.max_model_len for i in infos), min(i.vocab_size for i in infos)

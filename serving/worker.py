"""What both workers share: the servicer base (readiness, `GetInfo`, `GetStats`) and the life
of a worker process, which both `pdserve prefill-worker` and `pdserve decode-worker` (and the
Ray actors that run them) go through:

    listen (health NOT_SERVING) and serve /metrics ──► load the model, start the engine loop
        ──► SERVING, report the bound addresses ──► stop asked (signal, or the owner) ──►
        NOT_SERVING, stop the server (grace), stop the engine loop

A port of 0 binds a free one; the addresses actually bound are what `on_ready` receives.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, ClassVar

import grpc

from pdserve.engine.config import EngineConfig
from pdserve.engine.disagg import describe
from pdserve.serving.allocator import keep_freed_memory
from pdserve.serving.auth import ClusterSecurity
from pdserve.serving.convert import worker_info
from pdserve.serving.engine_thread import EngineLoop
from pdserve.serving.grpc_server import AioServer
from pdserve.serving.logs import progress
from pdserve.serving.metrics import WorkerMetrics, start_metrics_server
from pdserve.serving.tickets import ticket_key
from pdserve.v1 import worker_pb2

log = logging.getLogger("pdserve.server")


class WorkerService:
    """Base of both workers' servicers. `attach` is called once the model is loaded; until then
    every call answers UNAVAILABLE."""

    role: ClassVar[str]  # "prefill" or "decode"

    def __init__(self, metrics: WorkerMetrics | None = None, security: ClusterSecurity = ClusterSecurity()):
        self.metrics = metrics or WorkerMetrics(self.role)
        self.security = security
        self.ticket_key = ticket_key(security.token)
        self.advertised_address = ""  # where the other pool reaches this worker; set once it listens
        self.boot_id = secrets.token_hex(8)
        self.loop: EngineLoop | None = None
        self.info: worker_pb2.WorkerInfo | None = None
        self.kv_transfer_bytes_total = 0
        self.kv_transfer_failures_total = 0
        self.num_requests_total = 0  # taken: queued for prefill, or admitted for decode
        self.is_draining = False  # stopping: new requests are refused, live ones finish
        self.kv_allocator = None  # where the engine puts its KV cache, when not in ordinary memory

    def close(self) -> None:
        """Give back what outlives the process unless given back (shared-memory segments);
        called once the server stopped, whatever ended it."""

    def add_to(self, server: AioServer) -> None:
        """Register this servicer (and its health name) with a server."""
        raise NotImplementedError

    def server_options(self) -> list[tuple]:
        """Extra gRPC server options (the decode worker's, for the bulk KV push)."""
        return []

    def attach(self, loop: EngineLoop, model_name: str) -> None:
        self.loop, self.info = loop, worker_info(self.role, describe(loop.engine))
        self.metrics.attach(self, model_name)

    @property
    def engine(self):
        return self.loop.engine

    async def check_ready(self, context) -> None:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    async def check_accepting(self, context) -> None:
        """For calls that start a request: not while loading or draining."""
        await self.check_ready(context)
        if self.is_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this {self.role} worker is draining")

    @property
    def num_live_requests(self) -> int:
        """Requests that still need this worker (drain waits for none)."""
        raise NotImplementedError

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait up to `timeout_s` for the live ones to end; how many remain."""
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while self.loop is not None and self.num_live_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        remaining = self.num_live_requests if self.loop is not None else 0
        if remaining:
            log.warning("drain timeout: %d %s requests still live after %g s", remaining, self.role, timeout_s)
        return remaining

    async def GetInfo(self, request, context):
        await self.check_ready(context)
        return self.info

    async def GetStats(self, request, context):
        await self.check_ready(context)
        return self.stats()

    def stats(self) -> worker_pb2.WorkerStats:
        e = self.engine
        sched = e.scheduler
        return worker_pb2.WorkerStats(
            num_blocks=e.block_manager.num_blocks, num_free_blocks=e.block_manager.num_free_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_reserved=len(sched.held),
            num_queued_prompt_tokens=sched.num_uncomputed_tokens,
            kv_transfer_bytes_total=self.kv_transfer_bytes_total,
            kv_transfer_failures_total=self.kv_transfer_failures_total, num_requests_total=self.num_requests_total,
            prefix_cache_queries_total=sched.num_prefix_queried_tokens,
            prefix_cache_hits_total=sched.num_prefix_hit_tokens, boot_id=self.boot_id,
            max_num_seqs=sched.config.max_num_seqs, **self.extra_stats())

    def extra_stats(self) -> dict:
        return {}


def _projections(engine) -> str:
    """How a CPU engine's projections run, for the loaded line: packed panels (and their dtype,
    and whether many rows take the AMX tile unit) or torch's nn.Linear; nothing on a GPU."""
    if engine.device.type != "cpu":
        return ""
    if not engine.native_linear:
        return "; projections: nn.Linear"
    import torch

    from pdserve.engine.model.llama import PackedLinear

    dtypes = {m.packed.dtype for m in engine.runner.model.modules() if isinstance(m, PackedLinear)}
    half = dtypes == {torch.bfloat16}
    kinds = "bfloat16" if half else "float32" if dtypes == {torch.float32} else "float32 and bfloat16"
    # the fewest rows that take the tile unit (none: no AMX, or it is off)
    fewest = next((m for m in range(1, 65) if torch.ops.pdserve.linear_tile_rows(m)), None)
    tiles = f", AMX tiles from {fewest} rows" if torch.bfloat16 in dtypes and fewest else ""
    return f"; projections: packed {kinds} panels{tiles}"


def load_engine(config: EngineConfig, role: str, warmup: bool, kv_allocator=None):
    """Load the weights, allocate the KV cache and (unless told not to) run one tiny request
    through, so the first client's request pays no first-use cost (kernel compilation on a GPU,
    allocator growth); each step reported as it happens."""
    from pdserve.engine.llm_engine import LLMEngine  # torch: only where a worker runs
    from pdserve.engine.sampling_params import SamplingParams

    draft = f" and draft {config.draft_model}" if config.draft_model else ""
    progress(f"{role} worker: loading {config.model}{draft} and allocating the KV cache")
    started = time.perf_counter()
    engine = LLMEngine(config, kv_allocator)
    # the router detokenizes for its clients and the workers send token ids: the engine thread
    # detokenizes only requests with stop strings (5 µs a token on the demo, scratch timing)
    engine.text_outputs = False
    bm = engine.block_manager
    kv_bytes = sum(t.numel() * t.element_size() for t in _kv_tensors(engine))
    progress(f"{role} worker: loaded in {time.perf_counter() - started:.1f} s on {engine.device}: KV cache "
             f"{bm.num_blocks} blocks of {bm.block_size} tokens ({kv_bytes / 2**20:.1f} MiB)"
             f"{_projections(engine)}")
    if warmup:
        started = time.perf_counter()
        engine.add_request("warmup", [0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, seed=0))
        while engine.has_unfinished():
            engine.step()
        progress(f"{role} worker: warmed up in {time.perf_counter() - started:.2f} s")
    return engine


def _kv_tensors(engine):
    for runner in (engine.runner, engine.draft_runner):
        if runner is not None:
            for kv in runner.kv_caches:
                yield from (kv if isinstance(kv, (tuple, list)) else (kv,))


@dataclass(frozen=True, slots=True)
class BoundAddresses:
    grpc: str
    metrics: str | None


async def serve_worker(service: WorkerService, engine_config: EngineConfig, host: str, port: int,
                       metrics_port: int | None, until: Awaitable,
                       on_ready: Callable[[BoundAddresses], None] = lambda a: None, drain_timeout_s: float = 30.0,
                       grace_s: float = 1.0, advertise: str | None = None, warmup: bool = True,
                       model_name: str | None = None) -> None:
    """A worker's whole life, until `until` completes (a signal, or its owner's stop); then it
    drains: NOT_SERVING at once, new requests refused, live ones given `drain_timeout_s`.
    `advertise`: the address other processes reach it at (default: the one it bound). Loading and
    warming up report their progress (`serving.logs.progress`)."""

    keep_freed_memory()  # the KV path's large message buffers reused, not page-faulted in again each time
    until = asyncio.ensure_future(until)
    sec = service.security
    server = AioServer(host, port, extra_options=service.server_options(), interceptors=sec.interceptors(),
                       credentials=sec.tls.server_credentials() if sec.tls.enabled else None)
    service.add_to(server)
    await server.start()
    service.advertised_address = advertise or server.address
    metrics = None
    try:
        metrics_address = None
        if metrics_port is not None:
            metrics, bound = await start_metrics_server(service.metrics.registry, host, metrics_port)
            metrics_address = f"{host}:{bound}"
        engine = await asyncio.to_thread(load_engine, engine_config, service.role, warmup, service.kv_allocator)
        if until.done():  # stopped while loading: never serve, never say ready
            progress(f"{service.role} worker: stopped while loading")
            return
        loop = EngineLoop(engine, asyncio.get_running_loop(), f"{service.role}-engine")
        service.attach(loop, model_name or Path(engine_config.model).name)  # the router's name for it
        loop.start()
        await server.set_serving(True)
        log.info("serving role=%s address=%s model=%s num_blocks=%d", service.role, server.address,
                 engine_config.model, engine.block_manager.num_blocks)
        on_ready(BoundAddresses(service.advertised_address, metrics_address))
        await until
        await server.set_serving(False)
        await service.drain(drain_timeout_s)
    finally:
        await server.stop(grace=grace_s)
        if metrics is not None:
            await metrics.cleanup()
        if service.loop is not None:
            service.loop.stop()
        service.close()

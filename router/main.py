"""Composition root of `pdserve router`."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.tokenizer import Tokenizer
from pdserve.serving.metrics import start_metrics_server
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.serving.grpc_server import AioServer
from pdserve.router.admission import AdmissionQueue
from pdserve.router.metrics import RouterMetrics
from pdserve.router.server import GenerationServicer, Router
from pdserve.router.validate import Limits, Validator
from pdserve.router.workers import WorkerPool

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    rpc_timeout_s: float = 300.0
    connect_timeout_s: float = 120.0
    health_interval_s: float = 1.0
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    max_prompt_chars: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.decode_addresses:
            raise ValueError("RouterConfig.decode_addresses: at least one decode worker is required")
        for name in ("rpc_timeout_s", "connect_timeout_s", "health_interval_s", "queue_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"RouterConfig.max_queued_requests must be >= 0, got {self.max_queued_requests}")


async def serve(config: RouterConfig, host: str, port: int, http_port: int | None, metrics_port: int | None,
                until, on_ready=lambda addresses: None) -> None:
    """The router's life, until `until` completes: connect to the workers (ValueError if they
    are unreachable or mismatched), listen, report the bound addresses, serve."""
    tokenizer = Tokenizer.from_dir(config.model)
    pool = WorkerPool(list(config.prefill_addresses), list(config.decode_addresses), config.rpc_timeout_s)
    await pool.connect(config.connect_timeout_s)
    max_model_len, vocab_size = pool.limits()
    validator = Validator(tokenizer, Limits(max_model_len, vocab_size, config.max_prompt_chars))
    router = Router(pool, validator, tokenizer, AdmissionQueue(config.max_queued_requests),
                    config.rpc_timeout_s, config.queue_timeout_s, RouterMetrics(Path(config.model).name))
    server = AioServer(host, port)
    server.add(generation_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(router),
               generation_pb2.DESCRIPTOR.services_by_name["Generation"])
    await server.start()
    watcher = asyncio.create_task(pool.watch(config.health_interval_s))
    runners, addresses = [], {"grpc": server.address}
    try:
        if http_port is not None:
            from pdserve.router.http import start_http

            runner, bound = await start_http(router, host, http_port, Path(config.model).name)
            runners.append(runner)
            addresses["http"] = f"{host}:{bound}"
        if metrics_port is not None:
            runner, bound = await start_metrics_server(router.metrics.registry, host, metrics_port)
            runners.append(runner)
            addresses["metrics"] = f"{host}:{bound}"
        await server.set_serving(True)
        log.info("serving address=%s mode=%s", server.address, "colocated" if pool.is_colocated else "disaggregated")
        on_ready(addresses)
        await until
        await server.set_serving(False)
    finally:
        watcher.cancel()
        for runner in runners:
            await runner.cleanup()
        await server.stop(grace=2.0)

"""Composition root of `pdserve router`."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.engine.tokenizer import Tokenizer
from pdserve.serving.metrics import HTTP_IDLE_TIMEOUT_S, start_metrics_server
from pdserve.v1 import generation_pb2
from pdserve.serving.auth import ClusterSecurity, TLSFiles
from pdserve.serving.grpc_server import AioServer
from pdserve.router.admission import AdmissionQueue
from pdserve.router.api_keys import ApiKeys
from pdserve.router.metrics import SLO, RouterMetrics
from pdserve.router.server import GenerationServicer, Router, RouterPolicy
from pdserve.router.validate import Validator
from pdserve.router.workers import WorkerPool

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model: str  # its tokenizer and chat template are used
    served_model_name: str | None = None  # what /v1/models lists and requests must name; default: model's folder
    policy: RouterPolicy = RouterPolicy()
    connect_timeout_s: float = 120.0  # standalone: for the listed workers to come up
    health_interval_s: float = 1.0
    max_queued_requests: int = 1024
    max_prompt_chars: int = 1 << 20
    cluster: ClusterSecurity = ClusterSecurity()  # how it calls the workers
    tls: TLSFiles = TLSFiles()  # on its public ports
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    slo: SLO = SLO()  # requests meeting it count toward goodput (`pdserve:request_slo_met_total`)
    # the HTTP API's waits on a client: a connection with no request in progress (new, or idle
    # between requests) is closed after http_idle_timeout_s; a request's body must have arrived
    # http_body_timeout_s after its headers (else 408)
    http_idle_timeout_s: float = HTTP_IDLE_TIMEOUT_S
    http_body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "health_interval_s", "http_idle_timeout_s", "http_body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_queued_requests", "max_prompt_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"RouterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("RouterConfig.served_model_name must not be empty")

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name


def build_router(config: RouterConfig, pool: WorkerPool, model_name: str | None = None) -> Router:
    tokenizer = Tokenizer.from_dir(config.model)
    validator = Validator(tokenizer, config.max_prompt_chars, pool.limits)
    return Router(pool, validator, tokenizer, AdmissionQueue(config.max_queued_requests), config.policy,
                  RouterMetrics(model_name or config.name, slo=config.slo), config.api_keys)


async def serve(config: RouterConfig, prefill_addresses: list[str], decode_addresses: list[str], host: str,
                port: int, http_port: int | None, metrics_port: int | None, until,
                on_ready=lambda addresses: None, drain_timeout_s: float = 30.0, reuse_port: bool = False) -> None:
    """The standalone router: the listed workers (ValueError if they are unreachable or
    mismatched), then `serve_router`."""
    if not decode_addresses:
        raise ValueError("at least one decode worker is required (--decode)")
    pool = WorkerPool.static(prefill_addresses, decode_addresses, config.cluster)
    await pool.connect(config.connect_timeout_s)
    await serve_router(build_router(config, pool), config, host, port, http_port, metrics_port, until, on_ready,
                       drain_timeout_s, reuse_port)


async def serve_router(router: Router, config: RouterConfig, host: str, port: int, http_port: int | None,
                       metrics_port: int | None, until, on_ready=lambda addresses: None,
                       drain_timeout_s: float = 30.0, reuse_port: bool = False) -> None:
    """The router's life, until `until` completes: listen, report the bound addresses, watch the
    workers' health, and say SERVING (gRPC health, HTTP /ready) exactly while it can serve; then
    NOT_SERVING at once, and requests in flight get `drain_timeout_s` to finish. `reuse_port`:
    the gRPC and HTTP ports are shared with other routers of the same system (SO_REUSEPORT, the
    kernel spreads the connections); give each its own `metrics_port` then."""
    # gRPC itself refuses (uncounted) only requests past this; up to it the router reads every
    # request and answers an oversized one (wire.MAX_REQUEST_BYTES) itself, counted
    options = [("grpc.max_receive_message_length", 128 << 20)]
    server = AioServer(host, port, extra_options=options,
                       credentials=config.tls.server_credentials() if config.tls.enabled else None,
                       reuse_port=reuse_port)
    server.add(lambda servicer, grpc_server: grpc_server.add_generic_rpc_handlers((servicer.handler(),)),
               GenerationServicer(router), generation_pb2.DESCRIPTOR.services_by_name["Generation"])
    await server.start()
    tasks = [asyncio.create_task(router.pool.watch(config.health_interval_s)),
             asyncio.create_task(_follow_readiness(router.pool, server, config.health_interval_s / 2))]
    runners, addresses = [], {"grpc": server.address}
    try:
        if http_port is not None:
            from pdserve.router.chat_template import ChatTemplate
            from pdserve.router.http import start_http

            runner, bound = await start_http(router, host, http_port, config.name, ChatTemplate.from_dir(config.model),
                                             config.tls.ssl_context() if config.tls.enabled else None, reuse_port,
                                             config.http_idle_timeout_s, config.http_body_timeout_s)
            runners.append(runner)
            addresses["http"] = f"{host}:{bound}"
        if metrics_port is not None:
            runner, bound = await start_metrics_server(router.metrics.registry, host, metrics_port)
            runners.append(runner)
            addresses["metrics"] = f"{host}:{bound}"
        log.info("serving address=%s mode=%s", server.address, "disaggregated" if router.pool.is_disaggregated
                 else "colocated")
        on_ready(addresses)
        await until
        tasks[1].cancel()  # readiness stays NOT_SERVING from here on
        await server.set_serving(False)
        await router.drain(drain_timeout_s)
    finally:
        for task in tasks:
            task.cancel()
        router.calls.close()
        await server.set_serving(False)
        for runner in runners:
            await runner.cleanup()
        await server.stop(grace=2.0)


async def _follow_readiness(pool: WorkerPool, server: AioServer, interval_s: float) -> None:
    """SERVING while every pool the router needs has a usable worker."""
    serving = None
    while True:
        now = pool.missing() is None
        if now != serving:
            await server.set_serving(now)
            serving = now
        await asyncio.sleep(interval_s)

"""Composition root of `pdserve prefill-worker`: server first (health NOT_SERVING), then the
model, then SERVING; SIGTERM/SIGINT stop it gracefully."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.disagg import describe
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_worker.loop import PrefillLoop
from pdserve.prefill_worker.server import PrefillServerConfig, PrefillWorkerServicer
from pdserve.serving.convert import worker_info
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.serving.grpc_server import AioServer, serve_until_signal

log = logging.getLogger("pdserve.prefill")


def run(engine_config: EngineConfig, server_config: PrefillServerConfig, host: str, port: int,
        metrics_port: int | None = None) -> int:
    asyncio.run(serve(engine_config, server_config, host, port, metrics_port))
    return 0


async def serve(engine_config: EngineConfig, server_config: PrefillServerConfig, host: str, port: int,
                metrics_port: int | None = None) -> None:
    servicer = PrefillWorkerServicer(server_config)
    server = AioServer(host, port)
    server.add(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer,
               worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"])

    async def load():
        engine = await asyncio.to_thread(LLMEngine, engine_config)
        loop = PrefillLoop(engine, asyncio.get_running_loop())
        loop.start()
        servicer.metrics.attach(servicer, Path(engine_config.model).name)
        servicer.ready(loop, worker_info("prefill", describe(engine)))
        log.info("serving model=%s num_blocks=%d", engine_config.model, engine.block_manager.num_blocks)
        return loop.stop

    await serve_until_signal(server, host, load, servicer.metrics.registry, metrics_port)

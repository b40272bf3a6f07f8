"""Composition root of `pdserve decode-worker`: server first (health NOT_SERVING), then the
model, then SERVING; SIGTERM/SIGINT stop it gracefully."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pdserve.decode_worker.kv_receiver import KVReceiver
from pdserve.decode_worker.loop import DecodeLoop
from pdserve.decode_worker.server import DecodeServerConfig, DecodeWorkerServicer
from pdserve.engine.config import EngineConfig
from pdserve.engine.disagg import describe, kv_cache_groups, kv_group_layouts
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.convert import worker_info
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.serving.grpc_server import KV_TRANSFER_OPTIONS, AioServer, serve_until_signal

log = logging.getLogger("pdserve.decode")


def run(engine_config: EngineConfig, server_config: DecodeServerConfig, host: str, port: int,
        metrics_port: int | None = None) -> int:
    asyncio.run(serve(engine_config, server_config, host, port, metrics_port))
    return 0


async def serve(engine_config: EngineConfig, server_config: DecodeServerConfig, host: str, port: int,
                metrics_port: int | None = None) -> None:
    servicer = DecodeWorkerServicer(server_config)
    server = AioServer(host, port, extra_options=KV_TRANSFER_OPTIONS)  # it receives the KV pushes
    server.add(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer,
               worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"])

    async def load():
        engine = await asyncio.to_thread(LLMEngine, engine_config)
        loop = DecodeLoop(engine, asyncio.get_running_loop())
        loop.start()
        groups = list(zip(kv_group_layouts(engine), (kv for _, kv in kv_cache_groups(engine))))
        receiver = KVReceiver(groups, engine.dtype, engine_config.block_size, engine.model_config.vocab_size)
        servicer.metrics.attach(servicer, Path(engine_config.model).name)
        servicer.ready(loop, worker_info("decode", describe(engine)), receiver)
        log.info("serving model=%s num_blocks=%d", engine_config.model, engine.block_manager.num_blocks)
        return loop.stop

    await serve_until_signal(server, host, load, servicer.metrics.registry, metrics_port)

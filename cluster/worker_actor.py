"""`WorkerActor`: one pool's worker as a Ray actor. It runs exactly what `pdserve prefill-worker`
and `pdserve decode-worker` run (`serving.worker.serve_worker`), on an asyncio loop in a thread
of its own, bound to its node's address on a free port, and registers the addresses it bound
with the controller once it serves. Ray restarts it when its process dies (in its placement
group bundle, on another node if its node went away); the new incarnation registers again, at
its new address.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray

from pdserve.cluster.serving_actor import ServingActor
from pdserve.decode_worker import LOCAL_PREFILL_TOKENS
from pdserve.serving.logs import Telemetry


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str  # "prefill-0", "decode-3": the pool and a number never reused
    role: str
    engine_options: dict  # EngineConfig keyword arguments
    num_threads: int  # torch intra-op threads: the bundle's CPUs
    kv_transfer_timeout_s: float
    stream_timeout_s: float
    drain_timeout_s: float
    security: object  # serving.auth.ClusterSecurity: the cluster's secret and TLS files
    telemetry: Telemetry = Telemetry()
    kv_shm: bool = True  # K/V through shared memory with same-node peers
    model_name: str | None = None  # in metrics: the served model name, as the router's
    kv_dist: bool = False  # prefill: K/V bytes over a torch.distributed group to decode workers that take it
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS  # decode: prefill a prompt's short uncached tail here
    local_prefill_chunk_tokens: int | None = None  # decode: such tails' tokens a step (None: the device's default)
    stream_interval: int = 1  # decode: a request's tokens go out once this many are new


class WorkerActor(ServingActor):
    def __init__(self, spec: WorkerSpec, controller):
        self.spec = spec
        super().__init__(spec.worker_id, spec.role, spec.telemetry, controller)

    async def _serve(self, stopping: asyncio.Event) -> None:
        import torch

        from pdserve.engine.config import EngineConfig
        from pdserve.serving.worker import serve_worker

        torch.set_num_threads(self.spec.num_threads)
        host = ray.util.get_node_ip_address()
        await serve_worker(self._service(), EngineConfig(**self.spec.engine_options), host, 0, 0, stopping.wait(),
                           lambda addresses: self._registered(addresses.grpc, addresses.metrics or ""),
                           drain_timeout_s=self.spec.drain_timeout_s, model_name=self.spec.model_name)

    def _service(self):
        s = self.spec
        if s.role == "prefill":
            from pdserve.prefill_worker.server import PrefillServerConfig, PrefillWorkerServicer

            return PrefillWorkerServicer(PrefillServerConfig(kv_transfer_timeout_s=s.kv_transfer_timeout_s,
                                                             kv_shm=s.kv_shm, kv_dist=s.kv_dist),
                                         security=s.security)
        from pdserve.decode_worker.server import DecodeServerConfig, DecodeWorkerServicer

        return DecodeWorkerServicer(DecodeServerConfig(kv_transfer_timeout_s=s.kv_transfer_timeout_s,
                                                       stream_timeout_s=s.stream_timeout_s, kv_shm=s.kv_shm,
                                                       local_prefill_tokens=s.local_prefill_tokens,
                                                       local_prefill_chunk_tokens=s.local_prefill_chunk_tokens,
                                                       stream_interval=s.stream_interval),
                                    security=s.security)

"""`WorkerActor`: one pool's worker as a Ray actor. It runs exactly what `pdserve prefill-worker`
and `pdserve decode-worker` run (`serving.worker.serve_worker`), on an asyncio loop in a thread
of its own, bound to its node's address on a free port, and registers the addresses it bound
with the controller once it serves. Ray restarts it when its process dies (in its placement
group bundle, on another node if its node went away); the new incarnation registers again, at
its new address.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass

import ray

from pdserve.decode_worker import LOCAL_PREFILL_TOKENS
from pdserve.serving.logs import Telemetry

log = logging.getLogger("pdserve.cluster")


class StartFailed(RuntimeError):
    """A worker did not come to serve; the message names it and says why."""


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


@dataclass(frozen=True, slots=True)
class Member:
    """A serving worker, as it registers."""

    worker_id: str
    role: str
    address: str  # gRPC
    metrics_address: str
    node_id: str
    pid: int
    is_restart: bool  # Ray restarted this worker after its process died


class WorkerActor:
    def __init__(self, spec: WorkerSpec, controller):
        spec.telemetry.setup(f"pdserve-{spec.role}")
        self.spec, self.controller = spec, controller
        self.member: Member | None = None
        self.error: str | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        ctx = ray.get_runtime_context()
        self._node_id = ctx.get_node_id()
        with warnings.catch_warnings():  # Ray warns about its own use of a deprecated call here
            warnings.simplefilter("ignore")
            self._is_restart = bool(ctx.was_current_actor_reconstructed)
        threading.Thread(target=self._run, name=f"pdserve-{spec.worker_id}", daemon=True).start()

    # ---- called through Ray --------------------------------------------------------------
    def ready(self, timeout_s: float) -> Member:
        """The registration, once the worker serves; StartFailed if it failed to start."""
        if not self._ready.wait(timeout_s):
            raise StartFailed(f"worker {self.spec.worker_id} not serving after {timeout_s:g} s")
        if self.error is not None:
            raise StartFailed(f"worker {self.spec.worker_id} failed to start: {self.error}")
        return self.member

    def stop(self, timeout_s: float) -> None:
        """Drain (new requests refused, live ones get the drain timeout) and stop serving."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._done.wait(timeout_s)

    def pid(self) -> int:
        return os.getpid()

    # ---- the worker's own thread ---------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except Exception as e:  # noqa: BLE001 - reported through `ready`
            if isinstance(e, ValueError):  # what it was given is wrong (a checkpoint, an option): its message says what
                log.error("worker %s cannot start: %s", self.spec.worker_id, e)
                self.error = str(e)
            else:
                log.exception("worker %s failed", self.spec.worker_id)
                self.error = repr(e)
            self._ready.set()
            if self._is_restart:  # a restart that cannot serve: let Ray try again, not too fast
                time.sleep(5)
                os._exit(1)
        finally:
            self._done.set()

    async def _serve(self) -> None:
        import torch

        from pdserve.engine.config import EngineConfig
        from pdserve.serving.worker import serve_worker

        torch.set_num_threads(self.spec.num_threads)
        self._stop = asyncio.Event()
        host = ray.util.get_node_ip_address()
        await serve_worker(self._service(), EngineConfig(**self.spec.engine_options), host, 0, 0, self._stop.wait(),
                           self._on_ready, drain_timeout_s=self.spec.drain_timeout_s, model_name=self.spec.model_name)

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

    def _on_ready(self, addresses) -> None:
        self.member = Member(self.spec.worker_id, self.spec.role, addresses.grpc, addresses.metrics or "",
                             self._node_id, os.getpid(), self._is_restart)
        self.controller.register.remote(self.member)
        self._ready.set()

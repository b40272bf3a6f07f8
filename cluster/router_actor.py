"""`RouterActor`: one more router process of `pdserve serve` (`router.processes` > 1), a Ray actor
on the serve process's node. It runs what that process's own router runs
(`router.main.serve_router`), on the same public ports, shared through SO_REUSEPORT: the kernel
spreads client connections over the routers, so streaming and parsing get more than one core.

    created by the controller once the first router listens ──► follows the controller's
        membership ──► every worker of both pools healthy in its own pool ──► listens, its own
        /metrics on a free port ──► registers with the controller (role "router"): `pdserve
        status` and the Prometheus targets list it
    its process dies ──► the connections it held fail (their requests with them); new
        connections go to the other routers ──► Ray restarts it, it listens and registers again

A router keeps no state another needs: each holds its own requests, their failovers and its own
view of the workers' load, and every one follows the same membership.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import ray

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.worker_actor import Member, StartFailed
from pdserve.serving.logs import Telemetry

log = logging.getLogger("pdserve.cluster")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    router_id: str  # "router-1": router-0 is the serve process's own
    config: ServeConfig
    security: object  # serving.auth.ClusterSecurity
    telemetry: Telemetry
    grpc_port: int  # the first router's bound ports, shared
    http_port: int | None
    targets_path: str  # the Prometheus targets file the serve process keeps (`GET /prometheus/targets`)


class RouterActor:
    def __init__(self, spec: RouterSpec, controller):
        spec.telemetry.setup("pdserve-router")
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
        threading.Thread(target=self._run, name=f"pdserve-{spec.router_id}", daemon=True).start()

    # ---- called through Ray --------------------------------------------------------------
    def ready(self, timeout_s: float) -> Member:
        """The registration, once it listens; StartFailed if it failed to start."""
        if not self._ready.wait(timeout_s):
            raise StartFailed(f"{self.spec.router_id} not serving after {timeout_s:g} s")
        if self.error is not None:
            raise StartFailed(f"{self.spec.router_id} failed to start: {self.error}")
        return self.member

    def stop(self, timeout_s: float) -> None:
        """NOT_SERVING, in-flight requests get the drain timeout, then the ports are closed."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._done.wait(timeout_s)

    def pid(self) -> int:
        return os.getpid()

    # ---- the router's own thread ---------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except Exception as e:  # noqa: BLE001 - reported through `ready`
            log.error("%s cannot serve: %r", self.spec.router_id, e)
            self.error = str(e) if isinstance(e, (ValueError, OSError)) else repr(e)
            self._ready.set()
            if self._is_restart:  # a restart that cannot serve: let Ray try again, not too fast
                time.sleep(5)
                os._exit(1)
        finally:
            self._done.set()

    async def _serve(self) -> None:
        from pdserve.cluster.serve import follow_membership, router_config, wait_healthy
        from pdserve.router.main import build_router, serve_router
        from pdserve.router.workers import WorkerPool

        s, c = self.spec, self.spec.config
        self._stop = asyncio.Event()
        config = router_config(c, s.security)
        pool = WorkerPool(is_disaggregated=c.is_disaggregated, security=s.security)
        router = build_router(config, pool, c.name)
        router.prometheus_targets = lambda: _targets(Path(s.targets_path))
        follower = asyncio.create_task(follow_membership(self.controller, pool, None))
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            # no connection of a client lands here before this router knows every worker
            await wait_healthy(pool, c.prefill.workers + c.decode.workers, c.start_timeout, stopping)
            if not stopping.done():
                await serve_router(router, config, c.router.host, s.grpc_port, s.http_port, 0, stopping,
                                   self._on_ready, drain_timeout_s=c.router.drain_timeout, reuse_port=True)
        finally:
            follower.cancel()
            stopping.cancel()

    def _on_ready(self, addresses: dict) -> None:
        from pdserve.cluster.serve import reachable

        self.member = Member(self.spec.router_id, "router", addresses["grpc"], reachable(addresses["metrics"]) or "",
                             self._node_id, os.getpid(), self._is_restart)
        self.controller.register.remote(self.member)
        self._ready.set()


def _targets(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []

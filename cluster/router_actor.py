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
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.serving_actor import ServingActor
from pdserve.serving.logs import Telemetry


@dataclass(frozen=True, slots=True)
class RouterSpec:
    router_id: str  # "router-1": router-0 is the serve process's own
    config: ServeConfig
    security: object  # serving.auth.ClusterSecurity
    telemetry: Telemetry
    grpc_port: int  # the first router's bound ports, shared
    http_port: int | None
    targets_path: str  # the Prometheus targets file the serve process keeps (`GET /prometheus/targets`)


class RouterActor(ServingActor):
    def __init__(self, spec: RouterSpec, controller):
        self.spec = spec
        super().__init__(spec.router_id, "router", spec.telemetry, controller)

    async def _serve(self, stopping: asyncio.Event) -> None:
        from pdserve.cluster.serve import follow_membership, reachable, router_config, wait_healthy
        from pdserve.router.main import build_router, serve_router
        from pdserve.router.workers import WorkerPool

        s, c = self.spec, self.spec.config
        config = router_config(c, s.security)
        pool = WorkerPool(is_disaggregated=c.is_disaggregated, security=s.security)
        router = build_router(config, pool, c.name)
        router.prometheus_targets = lambda: _targets(Path(s.targets_path))
        follower = asyncio.create_task(follow_membership(self.controller, pool, None))
        until = asyncio.ensure_future(stopping.wait())
        try:
            # no connection of a client lands here before this router knows every worker
            await wait_healthy(pool, c.prefill.workers + c.decode.workers, c.start_timeout, until)
            if not until.done():
                await serve_router(router, config, c.router.host, s.grpc_port, s.http_port, 0, until,
                                   lambda addresses: self._registered(addresses["grpc"],
                                                                      reachable(addresses["metrics"]) or ""),
                                   drain_timeout_s=c.router.drain_timeout, reuse_port=True)
        finally:
            follower.cancel()
            until.cancel()


def _targets(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []

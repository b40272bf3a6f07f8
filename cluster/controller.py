"""`Controller`: the Ray actor that owns the pools — their placement groups and worker actors —
and the membership list the router follows. Named, so `pdserve scale` finds it in the cluster.

    start ──per pool: a placement group of one bundle per worker (SPREAD over nodes), then the
        worker actors in it──► each worker registers once it serves ──► membership version n
    scale ──more: another placement group and actors; fewer: the newest workers leave the
        membership first (no new traffic), drain, then are killed──► version n + k
    a worker's process dies ──Ray restarts the actor in its bundle──► it registers again, at a
        new address (version n + 1)
    start_routers (`router.processes` > 1, once the driver's router listens) ──the other router
        processes, on this node, on the same ports──► each registers (role "router") once it
        listens; the routers follow the workers, the targets file lists them all

The workers and routers are owned by this actor and it by the `pdserve serve` driver, so they all
end with it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.router_actor import RouterActor, RouterSpec
from pdserve.cluster.serving_actor import Member, StartFailed
from pdserve.cluster.worker_actor import WorkerActor, WorkerSpec
from pdserve.serving.logs import Telemetry, setup_logging

log = logging.getLogger("pdserve.cluster")

NAME, NAMESPACE = "pdserve-controller", "pdserve"


class PlacementFailed(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class Placed:
    worker_id: str
    role: str
    actor: object
    pg: object  # None: a router (no placement group; on the controller's node)


class Controller:
    def __init__(self, config: ServeConfig, security, telemetry: Telemetry = Telemetry()):
        setup_logging(telemetry.log_level, telemetry.log_format)
        self.config, self.security, self.telemetry = config, security, telemetry
        self.placed: dict[str, Placed] = {}
        self.members: dict[str, Member] = {}
        self.version = 0
        self._changed: asyncio.Condition | None = None
        self._numbers = {"prefill": itertools.count(), "decode": itertools.count(), "router": itertools.count(1)}
        self._self = ray.get_runtime_context().current_actor
        self._router_ports: tuple | None = None  # (gRPC, HTTP, targets file) once the routers share them

    # ---- membership ----------------------------------------------------------------------
    async def register(self, member: Member) -> None:
        """A worker serves (first start or restart): it joins, or moves to its new address."""
        if member.worker_id not in self.placed:  # drained while it was starting
            return
        self.members[member.worker_id] = member
        await self._bump()

    async def register_router(self, member: Member) -> None:
        """The serve process's own router (not an actor of this one's), listed beside the others."""
        self.members[member.worker_id] = member
        await self._bump()

    async def watch(self, version: int, timeout_s: float = 10.0) -> tuple[int, list[Member]]:
        """The membership once its version passes `version` (or after `timeout_s`): long polling."""
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self.version > version), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.version, list(self.members.values())

    async def _bump(self) -> None:
        cond = self._condition()
        async with cond:
            self.version += 1
            cond.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # created on the actor's event loop
            self._changed = asyncio.Condition()
        return self._changed

    # ---- pools ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Place every worker of both pools, then start them all at once and wait until each
        serves. PlacementFailed (saying what is missing) when the cluster cannot place them
        within the placement timeout; then no worker was started, so a pool the cluster cannot
        hold costs no model load (placing and starting one pool before the next loaded the
        prefill workers' models before finding there was no room for the decode pool)."""
        await self._grow(*((role, self._pool(role).workers) for role in ("prefill", "decode")))

    async def scale(self, prefill: int | None, decode: int | None, routers: int | None = None) -> dict[str, int]:
        """Absolute worker (and router process) counts; None leaves a pool as it is. Returns the
        counts now."""
        if routers is not None:
            await self._scale_routers(routers)
        for role, target in (("prefill", prefill), ("decode", decode)):
            if target is None:
                continue
            if target < (1 if role == "decode" else 0):
                raise ValueError(f"--{role} must be >= {1 if role == 'decode' else 0}, got {target}")
            if role == "prefill" and (target > 0) != self.config.is_disaggregated:
                raise ValueError("the prefill pool cannot be started or removed while serving "
                                 "(colocated and disaggregated routers differ): restart with the new config")
            current = self.count(role)
            if target > current:
                await self._grow((role, target - current))
            elif target < current:
                await self._shrink(role, current - target)
        return {**{role: self.count(role) for role in ("prefill", "decode")}, "routers": 1 + self.count("router")}

    async def _scale_routers(self, target: int) -> None:
        if not isinstance(target, int) or target < 1:
            raise ValueError(f"--routers must be >= 1 (the serve process's own router stays), got {target}")
        if self._router_ports is None:
            raise ValueError("the router's ports are not shared: to scale the routers, start `pdserve serve` with "
                             "router.processes above 1 (--router-processes)")
        current = 1 + self.count("router")
        if target > current:
            await self.start_routers(target - current, *self._router_ports)
        elif target < current:
            await self._shrink("router", current - target)

    def count(self, role: str) -> int:
        return sum(1 for p in self.placed.values() if p.role == role)

    async def status(self) -> dict:
        return {"version": self.version, "members": list(self.members.values()),
                "placed": {p.worker_id: p.role for p in self.placed.values()}}

    async def pid_of(self, worker_id: str) -> int:
        return await self.placed[worker_id].actor.pid.remote()

    async def stop(self) -> None:
        """Drain and stop the routers, then every worker, then free their placement groups."""
        await self.stop_routers()
        await asyncio.gather(*(self._remove(p) for p in list(self.placed.values())))

    # ---- the other routers ---------------------------------------------------------------
    async def start_routers(self, n: int, grpc_port: int, http_port: int | None, targets_path: str) -> None:
        """`n` more router processes on this node, sharing the driver's router's ports; returns
        once each listens (StartFailed, saying why, if one does not)."""
        self._router_ports = (grpc_port, http_port, targets_path)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        new = []
        for _ in range(n):
            router_id = f"router-{next(self._numbers['router'])}"
            spec = RouterSpec(router_id, self.config, self.security, self.telemetry, grpc_port, http_port,
                              targets_path)
            # no CPUs reserved, as the driver's router: the pools' bundles hold the cluster's CPUs
            actor = ray.remote(RouterActor).options(
                name=f"pdserve-{router_id}", namespace=NAMESPACE, num_cpus=0, max_restarts=-1, max_concurrency=4,
                scheduling_strategy=here).remote(spec, self._self)
            new.append(self.placed.setdefault(router_id, Placed(router_id, "router", actor, None)))
        try:
            await asyncio.gather(*(p.actor.ready.remote(self.config.start_timeout) for p in new))
        except Exception as e:
            cause = getattr(e, "cause", e)
            raise StartFailed(str(cause) if isinstance(cause, StartFailed) else f"a router failed to start: {cause}")

    async def stop_routers(self) -> None:
        """Drain and stop the other routers (the driver's drains beside them)."""
        await asyncio.gather(*(self._remove(p) for p in list(self.placed.values()) if p.role == "router"))

    def _pool(self, role: str):
        return self.config.prefill if role == "prefill" else self.config.decode

    async def _grow(self, *counts: tuple[str, int]) -> None:
        """More workers, (role, how many) each: a placement group per pool, all placed within
        one placement timeout before any worker starts, then every new worker started at once."""
        groups: list[tuple[str, int, object]] = []
        deadline = asyncio.get_running_loop().time() + self.config.placement_timeout
        try:
            for role, n in counts:
                if n:
                    groups.append((role, n, placement_group([self._pool(role).bundle()] * n, strategy="SPREAD")))
            for role, n, pg in groups:
                try:
                    await asyncio.wait_for(pg.ready(), max(deadline - asyncio.get_running_loop().time(), 0.0))
                except asyncio.TimeoutError:
                    raise PlacementFailed(self._missing(role, n, self._pool(role).bundle())) from None
        except BaseException:
            for _, _, pg in groups:
                remove_placement_group(pg)
            raise
        if not groups:
            return
        new = [self._create(role, pg, i, self._pool(role).num_threads) for role, n, pg in groups for i in range(n)]
        waiting = {asyncio.ensure_future(p.actor.ready.remote(self.config.start_timeout)): p for p in new}
        done, pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        for task in done:
            if (e := task.exception()) is not None:  # Ray wraps the worker's error: keep its message
                cause = getattr(e, "cause", e)
                raise PlacementFailed(str(cause) if isinstance(cause, StartFailed) else
                                      f"worker {waiting[task].worker_id} failed to start: {cause}")

    def _create(self, role: str, pg, bundle: int, num_threads: int) -> Placed:
        worker_id = f"{role}-{next(self._numbers[role])}"
        c = self.config
        spec = WorkerSpec(worker_id, role, c.engine_options(role), num_threads, c.kv_transfer_timeout,
                          c.stream_timeout, c.router.drain_timeout, self.security, self.telemetry, c.kv_shm, c.name,
                          c.kv_dist, c.local_prefill_tokens, c.local_prefill_chunk_tokens, c.stream_interval)
        pool = self._pool(role)
        actor = ray.remote(WorkerActor).options(
            name=f"pdserve-{worker_id}", namespace=NAMESPACE, num_cpus=pool.cpus, num_gpus=pool.gpus,
            max_restarts=-1, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(spec, self._self)
        placed = self.placed[worker_id] = Placed(worker_id, role, actor, pg)
        return placed

    async def _shrink(self, role: str, n: int) -> None:
        newest = sorted((p for p in self.placed.values() if p.role == role),
                        key=lambda p: int(p.worker_id.rsplit("-", 1)[1]))[-n:]
        await asyncio.gather(*(self._remove(p) for p in newest))

    async def _remove(self, p: Placed) -> None:
        """Out of the membership first (no new traffic), then drain, then gone."""
        self.members.pop(p.worker_id, None)
        await self._bump()
        drain = self.config.router.drain_timeout
        try:
            await asyncio.wait_for(p.actor.stop.remote(drain), drain + 10)
        except Exception as e:  # noqa: BLE001 - it is killed anyway
            log.warning("worker %s did not stop cleanly: %r", p.worker_id, e)
        ray.kill(p.actor, no_restart=True)
        del self.placed[p.worker_id]
        if p.pg is not None and not any(q.pg is p.pg for q in self.placed.values()):
            remove_placement_group(p.pg)

    @staticmethod
    def _missing(role: str, n: int, bundle: dict[str, float]) -> str:
        free = ray.available_resources()
        have = ", ".join(f"{k} {free.get(k, 0):g}" for k in bundle)
        return (f"cannot place {n} {role} worker{'s' * (n > 1)} of {bundle} each within the placement timeout: "
                f"the cluster has {have} available (resources: {ray.cluster_resources()})")

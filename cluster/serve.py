"""`pdserve serve`: the whole system on Ray.

    start Ray (embedded: a private local instance on loopback with a fresh auth token; or join
        `--ray-address`) ──► the controller places the pools (`controller.py`) ──► the router,
        in this process, follows the membership the workers register ──► every worker healthy:
        `pdserve ready: …` ──► SIGINT/SIGTERM: NOT_SERVING, in-flight requests drain, workers
        drain and stop, Ray stops (when embedded)

Prometheus: a file-SD target list of every process (router and workers) is kept current as
workers join, restart and leave; the router's HTTP API serves the same list for Prometheus'
HTTP service discovery (`GET /prometheus/targets`), where Prometheus cannot read the file (a
pod). `pdserve scale` finds the controller through Ray; for an embedded Ray it reads how to
connect from the connection file this command writes (0600).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from pathlib import Path

from pdserve.cluster.config import ServeConfig
from pdserve.serving.logs import progress

log = logging.getLogger("pdserve.cluster")


def connection_file() -> Path:
    """Where a local `pdserve serve` says how to reach it (PDSERVE_RUNTIME_DIR moves it)."""
    root = os.environ.get("PDSERVE_RUNTIME_DIR") or os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/pdserve-{os.getuid()}"
    return Path(root) / "serve.json"


def stop_ray(timeout_s: float = 20.0) -> None:
    """ray.shutdown(), bounded: when Ray's own processes are already gone it can wait a long
    time on them, so after `timeout_s` the processes this command started are killed outright."""
    import threading

    import ray

    node = ray._private.worker._global_node
    done = threading.Thread(target=ray.shutdown, daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive() and node is not None:
        log.warning("Ray did not shut down within %g s: killing its processes", timeout_s)
        node.kill_all_processes(check_alive=False, allow_graceful=False)


def start_ray(ray_address: str | None, num_cpus: int | None = None, dashboard: bool = True) -> dict:
    """Connect to Ray; returns how others connect to it ({"address", "token"}). Embedded (no
    address): a private local instance whose every address is loopback, with token
    authentication on; its env is set before `ray` is imported, which reads it at import.
    dashboard=False: the embedded instance starts its dashboard minimal, without the ten
    processes of its modules (the state API behind `ray list actors` among them): `ray.init`
    took 6-7 s instead of 8-9 s on a 2-core host."""
    embedded = ray_address is None
    if embedded:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node address: loopback, not the host's IP
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        os.environ.pop("RAY_ADDRESS", None)
    import ray

    kwargs = dict(namespace="pdserve", log_to_driver=True, configure_logging=True, logging_level=logging.WARNING)
    if embedded:
        # the dashboard (when ray[default] is installed) serves `ray list actors`; on loopback, behind the token
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), dashboard_host="127.0.0.1",
                 include_dashboard=None if dashboard else False, **kwargs)
    else:
        ray.init(address=ray_address, **kwargs)
    return {"address": ray.get_runtime_context().gcs_address, "token": os.environ.get("RAY_AUTH_TOKEN")}


def write_connection_file(connection: dict, embedded: bool) -> Path:
    """How `pdserve scale` reaches this system (the token too: owner-only permissions)."""
    path = connection_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({**connection, "embedded": embedded, "pid": os.getpid()}, f)
    return path


def connect_to_running(ray_address: str | None):
    """The controller of a running `pdserve serve` (ValueError when there is none)."""
    if ray_address is None:
        try:
            info = json.loads(connection_file().read_text())
        except FileNotFoundError:
            raise ValueError(f"no local `pdserve serve` is running ({connection_file()} does not exist); "
                             "pass --ray-address for one on a cluster") from None
        ray_address = info["address"]
        if info.get("embedded"):
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        if info.get("token"):
            os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = "token", info["token"]
    import ray

    from pdserve.cluster.controller import NAME, NAMESPACE

    ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no pdserve system runs on the Ray cluster at {ray_address}") from None


class TargetsFile:
    """Prometheus file-SD targets of every process, rewritten whole (atomically) on each change."""

    def __init__(self, path: Path, model_name: str):
        self.path, self.model_name = path, model_name
        self.router: str | None = None
        self.members: list = []

    def write(self, members=None) -> None:
        """With the workers' registrations (None: the last ones), and the router once it listens."""
        self.members = self.members if members is None else list(members)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.groups(), indent=1) + "\n")
        tmp.replace(self.path)

    def groups(self) -> list[dict]:
        """The target groups, as Prometheus' file and HTTP service discovery read them."""
        groups = []
        if self.router and all(m.metrics_address != self.router for m in self.members):  # else it registered
            groups.append({"targets": [self.router], "labels": {"pdserve_role": "router"}})
        groups += [{"targets": [m.metrics_address], "labels": {"pdserve_role": m.role, "pdserve_worker": m.worker_id,
                                                                "pdserve_node": m.node_id[:12]}}
                   for m in sorted(self.members, key=lambda m: m.worker_id) if m.metrics_address]
        for g in groups:
            g["labels"]["model_name"] = self.model_name
        return groups


class Progress:
    """One line on stderr per stage (`serving.logs.progress`: any level, the log format)."""

    def __init__(self) -> None:
        self._last = ""

    def __call__(self, message: str) -> None:
        if message != self._last:
            progress(message)
            self._last = message


async def follow_membership(controller, pool, targets: TargetsFile | None,
                            on_change=lambda members: None) -> None:
    """Keep a router's pool (and the targets file, given one) equal to the controller's
    membership: its workers; the other routers are in the targets only."""
    version, known, listed = 0, {}, []
    while True:
        version, members = await controller.watch.remote(version)
        now = {m.worker_id: m for m in members if m.role != "router"}
        for worker_id in set(known) - set(now):
            pool.remove(worker_id)
        for m in now.values():
            if known.get(m.worker_id) != m:
                pool.add(m.worker_id, m.role, m.address)
        if targets is not None and members != listed:
            targets.write(members)
        if now != known:
            on_change(list(now.values()))
        known, listed = now, members


def router_config(config: ServeConfig, security):
    """What every router of the system runs with (`router.main.RouterConfig`)."""
    from pdserve.router.api_keys import ApiKeys
    from pdserve.router.main import RouterConfig
    from pdserve.router.metrics import SLO
    from pdserve.router.server import RouterPolicy
    from pdserve.serving.auth import TLSFiles

    r, sec = config.router, config.security
    return RouterConfig(model=config.model, served_model_name=config.served_model_name, policy=RouterPolicy(
        rpc_timeout_s=r.rpc_timeout, queue_timeout_s=r.queue_timeout, max_failovers=r.max_failovers,
        failover_wait_s=r.failover_wait, token_streams=r.token_streams), health_interval_s=r.health_interval,
        max_queued_requests=r.max_queued_requests, max_prompt_chars=r.max_prompt_chars, cluster=security,
        tls=TLSFiles(sec.tls_cert, sec.tls_key),
        api_keys=ApiKeys.from_flags(sec.api_keys, sec.api_key_rate_limit, sec.api_key_max_concurrency),
        slo=SLO(r.slo_ttft, r.slo_tpot), http_idle_timeout_s=r.http_idle_timeout, http_body_timeout_s=r.http_body_timeout)


async def serve(config: ServeConfig, ray_address: str | None, telemetry, until, on_ready) -> None:
    """`telemetry` (`serving.logs.Telemetry`): how this process logs and traces, passed on to
    the controller and every worker."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pdserve.cluster.controller import NAME, NAMESPACE, Controller, PlacementFailed
    from pdserve.router.main import build_router, serve_router
    from pdserve.router.workers import WorkerPool

    progress = Progress()
    security = config.cluster_security()
    progress(f"Ray at {ray.get_runtime_context().gcs_address}; placing {config.prefill.workers} prefill and "
             f"{config.decode.workers} decode workers")
    # the controller owns the worker actors, and an owner's death takes them with it: it lives on
    # this process's node, so losing another node never takes the whole system down
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    controller = ray.remote(Controller).options(name=NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=1000,
                                                scheduling_strategy=here).remote(config, security, telemetry)
    r, shared = config.router, config.router.processes > 1
    pool = WorkerPool(is_disaggregated=config.is_disaggregated, security=security)
    router = build_router(router_config(config, security), pool, config.name)
    targets = TargetsFile(Path(config.metrics_targets_file or _session_dir() / "pdserve_targets.json"), config.name)
    total = config.prefill.workers + config.decode.workers
    follower = asyncio.create_task(follow_membership(
        controller, pool, targets, lambda ms: progress(f"{len(ms)}/{total} workers serving")))
    try:
        starting = asyncio.ensure_future(controller.start.remote())
        await _first_of(starting, until)
        if until.done():
            return
        try:
            await starting
        except Exception as e:  # noqa: BLE001 - Ray wraps the controller's error; its cause says what is missing
            cause = getattr(e, "cause", e)
            if isinstance(cause, PlacementFailed):
                raise ValueError(str(cause.args[0] if cause.args else cause)) from None
            raise
        await wait_healthy(pool, total, config.start_timeout, until)
        progress("all workers healthy")

        listening = asyncio.get_running_loop().create_future()

        def ready(addresses: dict) -> None:
            targets.router = reachable(addresses.get("metrics") or addresses.get("http"))
            targets.write()
            listening.set_result(addresses)

        router.prometheus_targets = targets.groups
        # with other routers on the same ports, /metrics on the HTTP port would answer for any
        # of them: each has a port of its own for it
        stopping = asyncio.get_running_loop().create_future()
        until.add_done_callback(lambda _: stopping.done() or stopping.set_result(None))
        serving = asyncio.create_task(serve_router(
            router, router_config(config, security), r.host, r.grpc_port, r.http_port, 0 if shared else None,
            stopping, ready, drain_timeout_s=r.drain_timeout, reuse_port=shared))
        await _first_of(listening, serving)
        if not listening.done():
            return await serving  # it could not listen: its error
        addresses = listening.result()
        if shared:  # listed with the others in `pdserve status` and the targets
            from pdserve.cluster.serving_actor import Member

            await controller.register_router.remote(Member(
                "router-0", "router", addresses["grpc"], targets.router or "", ray.get_runtime_context().get_node_id(),
                os.getpid(), False))
            progress(f"starting {r.processes - 1} more router process{'es' * (r.processes > 2)}")
            starting = asyncio.ensure_future(controller.start_routers.remote(
                r.processes - 1, _port(addresses["grpc"]), _port(addresses.get("http")), str(targets.path)))
            await _first_of(starting, until)
            if until.done():  # stopped while they start: the controller stops them with the rest
                starting.cancel()
                return await serving
            try:
                await starting
            except Exception as e:  # noqa: BLE001 - Ray wraps the controller's error; its cause says why
                stopping.done() or stopping.set_result(None)
                await serving
                raise ValueError(str(getattr(e, "cause", e))) from None
        on_ready({**addresses, "ray": ray.get_runtime_context().gcs_address, "prefill": config.prefill.workers,
                  "decode": config.decode.workers, "routers": r.processes, "targets": str(targets.path)})
        await _first_of(serving, until)
        if shared:  # the other routers drain beside this one
            await _quietly(controller.stop_routers.remote(), r.drain_timeout + 15, "routers")
        await serving
    finally:
        follower.cancel()
        progress("stopping workers")
        await _quietly(controller.stop.remote(), r.drain_timeout + 15, "workers")
        ray.kill(controller)


async def _quietly(ref, timeout_s: float, what: str) -> None:
    try:
        await asyncio.wait_for(asyncio.ensure_future(ref), timeout_s)
    except Exception as e:  # noqa: BLE001 - shutting down regardless
        log.warning("%s did not stop cleanly: %r", what, e)


def _port(address: str | None) -> int | None:
    return None if address is None else int(address.rsplit(":", 1)[1])


async def _first_of(task, until) -> None:
    await asyncio.wait([task, until], return_when=asyncio.FIRST_COMPLETED)


async def wait_healthy(pool, total: int, timeout_s: float, until) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(1 for w in pool.workers.values() if w.healthy) < total and not until.done():
        await asyncio.gather(*(pool.check(w) for w in list(pool.workers.values())))
        if time.monotonic() > deadline:
            sick = [f"{w.worker_id} at {w.address}" for w in pool.workers.values() if not w.healthy]
            raise RuntimeError(f"workers not healthy after {timeout_s:g} s: {sick}")
        await asyncio.sleep(0.1)


def reachable(address: str | None) -> str | None:
    """A listening address others can scrape: a wildcard host (a pod's 0.0.0.0) becomes this node's IP."""
    if address is None:
        return None
    host, port = address.rsplit(":", 1)
    if host in ("0.0.0.0", "::", "[::]"):
        import ray

        host = ray.util.get_node_ip_address()
    return f"{host}:{port}"


def _session_dir() -> Path:
    import ray

    path = Path(ray._private.worker._global_node.get_session_dir_path())  # the Ray logs' folder
    return path if path.is_dir() else Path("/tmp")

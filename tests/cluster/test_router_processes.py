"""`pdserve serve` with two router processes (`router.processes: 2`): the serve process's router
and one Ray actor share the public gRPC and HTTP ports (SO_REUSEPORT), the kernel spreads the
client connections over them, both serve what the offline engine computes, each has its own
/metrics in the Prometheus targets; `pdserve bench --connections` reaches both; `pdserve scale
--routers` adds and drains routers while serving; a router killed with -9 costs only the
connections it held, the other takes the new ones, and Ray restarts it on the same ports; SIGTERM
drains them all and leaves nothing behind."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc
from serve_system import serve_config, start_system

PROMPTS = [f"request {i}: def f(x):" for i in range(16)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def system(serving_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routers")
    config = serve_config(serving_model, spec=False, cpus=0.4, metrics_targets_file=str(tmp / "targets.json"))
    config["router"]["processes"] = 2
    s = start_system(tmp, "routers", config, "--no-ray-dashboard")
    s.targets_file = Path(config["metrics_targets_file"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(serving_model) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in LLM(str(serving_model)).generate(PROMPTS, params)]


def _each_on_its_own_connection(address: str) -> list[list[int] | grpc.aio.AioRpcError]:
    """PROMPTS' tokens, each request on a connection of its own (its own subchannel pool)."""
    async def one(prompt: str):
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            req = gen.GenerateRequest(prompt=prompt, sampling_params=gen.SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
            try:
                return [t async for m in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=60)
                        for t in m.token_ids]
            except grpc.aio.AioRpcError as e:
                return e

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    return asyncio.run(main())


def _completions_over_http(address: str) -> list[dict]:
    """PROMPTS over the OpenAI API, a connection each (urllib does not keep one alive)."""
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    out = []
    for prompt in PROMPTS:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://{address}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out.append(json.loads(resp.read()))
    return out


def _ok_requests(metrics_address: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:requests_total{") and 'status="ok"' in line)


def _listeners(address: str) -> int:
    """The sockets listening on `address`'s port: one a router."""
    port = int(address.rsplit(":", 1)[1])
    return sum(1 for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def _wait_closed(address: str, listeners: int, timeout_s: float = 30) -> None:
    """Until `listeners` sockets listen on the port. A killed process's socket outlives its pid's
    exit while its other threads tear down, and connections it queued then are reset."""
    deadline = time.monotonic() + timeout_s
    while _listeners(address) != listeners:
        assert time.monotonic() < deadline, f"{_listeners(address)} sockets listen on {address}, not {listeners}"
        time.sleep(0.02)


def _routers(system) -> list[dict]:
    return system.workers("router")


def test_both_routers_serve_on_the_shared_ports(system, expected):
    routers = _routers(system)  # the serve process's own, and the actor
    assert [r["worker_id"] for r in routers] == ["router-0", "router-1"]
    assert routers[0]["pid"] == system.proc.popen.pid != routers[1]["pid"]
    assert routers[0]["address"] == routers[1]["address"] == system.grpc_address
    metrics = [system.proc.addresses["metrics"], routers[1]["metrics_address"]]
    assert routers[0]["metrics_address"] == metrics[0]
    # the targets list both routers, each at its own /metrics
    groups = json.loads(system.targets_file.read_text())
    assert sorted(t for g in groups if g["labels"]["pdserve_role"] == "router" for t in g["targets"]) == sorted(metrics)
    before = [_ok_requests(m) for m in metrics]

    got = _each_on_its_own_connection(system.grpc_address)
    assert got == expected
    http = _completions_over_http(system.http_address)
    assert all(c["choices"][0]["text"] for c in http) and len(http) == len(PROMPTS)

    served = [_ok_requests(m) - b for m, b in zip(metrics, before)]
    # /metrics on the shared HTTP port would mix the routers' counters: it says where to scrape
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{system.http_address}/metrics", timeout=10)
    assert e.value.code == 404 and "its own metrics port" in e.value.read().decode()
    # 32 connections: all on one router has odds of 2 in 2^32
    assert sum(served) == 2 * len(PROMPTS) and min(served) > 0, served


def test_the_load_generator_spreads_its_connections_over_both(system, tmp_path):
    metrics = [r["metrics_address"] for r in _routers(system)]
    before = [_ok_requests(m) for m in metrics]
    out = system.cli("bench", "--target", system.grpc_address, "--connections", "16", "--workload", "random",
                     "--vocab-size", "300", "--prompt-len", "fixed:16", "--output-len", "fixed:4", "--num-requests",
                     "32", "--max-concurrency", "16", "--warmup", "0", "--output", str(tmp_path / "b.json"),
                     "--no-plot", "--quiet")
    assert out.returncode == 0, out.stderr
    run = json.loads((tmp_path / "b.json").read_text())
    assert run["config"]["connections"] == 16
    served = [_ok_requests(m) - b for m, b in zip(metrics, before)]
    assert sum(served) == 32 and min(served) > 0, served
    bad = system.cli("bench", "--target", system.grpc_address, "--connections", "0", "--quiet")
    assert bad.returncode == 2 and "connections must be an integer >= 1, got 0" in bad.stderr, bad.stderr


def test_routers_scale_while_serving(system, expected):
    assert "routers=3" in system.scale(routers=3)
    assert [r["worker_id"] for r in _routers(system)] == ["router-0", "router-1", "router-2"]
    assert _listeners(system.grpc_address) == 3
    new = _routers(system)[2]["metrics_address"]
    before = _ok_requests(new)
    for _ in range(2):
        assert _each_on_its_own_connection(system.grpc_address) == expected
    assert _ok_requests(new) > before  # 32 connections over three routers: it got some
    assert "routers=2" in system.scale(routers=2)  # the newest goes, drained
    assert [r["worker_id"] for r in _routers(system)] == ["router-0", "router-1"]
    _wait_closed(system.grpc_address, 2)
    out = system.cli("scale", "--routers=0")
    assert out.returncode == 2 and "--routers must be >= 1" in out.stderr, out.stderr


def test_a_router_killed_with_9_costs_only_its_connections_and_comes_back(system, expected):
    victim = _routers(system)[1]
    assert _listeners(system.grpc_address) == 2
    os.kill(victim["pid"], signal.SIGKILL)
    _wait_closed(system.grpc_address, 1)
    # the kernel gives new connections to the router still listening: none of them fails (before its
    # socket closed, those it had queued were reset: the connections it held, in the kernel)
    assert _each_on_its_own_connection(system.grpc_address) == expected
    deadline = time.monotonic() + 120
    while not (back := [r for r in _routers(system)[1:] if r["pid"] != victim["pid"]]):
        assert time.monotonic() < deadline, _routers(system)
        time.sleep(0.5)
    assert back[0]["is_restart"] and back[0]["address"] == victim["address"]  # the same shared port
    before = _ok_requests(back[0]["metrics_address"])
    assert _each_on_its_own_connection(system.grpc_address) == expected
    assert _ok_requests(back[0]["metrics_address"]) > before  # it takes connections again


def test_sigterm_drains_every_router_and_leaves_no_process(system):
    routers = [r["pid"] for r in _routers(system)[1:]]
    tree = psutil.Process(system.proc.popen.pid).children(recursive=True)
    assert set(routers) <= {p.pid for p in tree}
    code, seconds = system.stop(timeout_s=90)
    assert code == 0 and seconds < 60, system.proc.log_tail()
    time.sleep(1)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert _listeners(system.grpc_address) == 0

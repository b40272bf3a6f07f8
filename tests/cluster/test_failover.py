"""Faults on `pdserve serve` (each destructive test gets its own short-lived system): a worker
killed with -9 mid-stream loses no token, Ray restarts it and it serves again, scaling under
load loses no request, and SIGTERM leaves no process behind."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import psutil
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.serving.auth import CLUSTER_TOKEN_METADATA
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from serve_system import serve_config, start_system, stream_all, tokens

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "héllo wörld", "class Foo:\n    pass",
           "x = [1, 2", "for i in range(", "while True:", "return self."]
GREEDY = dict(temperature=0, max_tokens=400, ignore_eos=True)
SAMPLED = dict(temperature=0.9, top_p=0.95, max_tokens=400, ignore_eos=True)


def requests() -> list[gen.GenerateRequest]:
    """Eight long greedy streams and four seeded sampled ones."""
    greedy = [gen.GenerateRequest(prompt=p, sampling_params=gen.SamplingParams(**GREEDY)) for p in PROMPTS]
    sampled = [gen.GenerateRequest(prompt=p, sampling_params=gen.SamplingParams(seed=100 + i, **SAMPLED))
               for i, p in enumerate(PROMPTS[:4])]
    return greedy + sampled


@pytest.fixture(scope="module")
def expected(serving_model) -> list[list[int]]:
    """What an undisturbed run gives (no speculation in these systems: sampling is then a pure
    function of (seed, position), whichever worker continues a stream)."""
    llm = LLM(str(serving_model))
    params = [SamplingParams(**GREEDY)] * 8 + [SamplingParams(seed=100 + i, temperature=gen.SamplingParams(
        temperature=0.9).temperature, top_p=gen.SamplingParams(top_p=0.95).top_p, max_tokens=400, ignore_eos=True)
        for i in range(4)]
    return [o.token_ids for o in llm.generate(PROMPTS + PROMPTS[:4], params)]


CLUSTER_TOKEN = "failover-test-cluster-secret-0123"  # the workers' GetStats needs the cluster's credentials


@pytest.fixture(scope="module")
def system(serving_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failover")
    (tmp / "cluster.token").write_text(CLUSTER_TOKEN)
    config = serve_config(serving_model, prefill=2, decode=2, spec=False, cpus=0.4, placement_timeout=10)
    config["security"] = {"cluster_token_file": str(tmp / "cluster.token")}
    s = start_system(tmp, "failover", config, "--no-ray-dashboard")
    yield s
    s.stop()


def stats(address: str, role: str = "decode") -> worker_pb2.WorkerStats:
    stub = worker_pb2_grpc.DecodeWorkerStub if role == "decode" else worker_pb2_grpc.PrefillWorkerStub
    with grpc.insecure_channel(address) as channel:
        return stub(channel).GetStats(worker_pb2.StatsRequest(), timeout=10,
                                      metadata=[(CLUSTER_TOKEN_METADATA, CLUSTER_TOKEN)])


def test_kill_9_of_a_decode_worker_mid_stream_loses_no_token(system, expected):
    decoders = system.workers("decode")
    killed: list[dict] = []

    def kill():
        # the first decode worker seen holding streams (each has sent its first token, which the
        # prefill worker samples). Watched from before the requests go out: a stream on this tiny
        # model decodes its 400 tokens in about a second, and waiting for every stream's first
        # token first could find the chosen victim done already (seen on a loaded CI machine)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for w in decoders:
                try:
                    running = stats(w["address"]).num_running
                except grpc.RpcError:  # a busy worker's stats may time out: ask again
                    continue
                if running:
                    os.kill(w["pid"], signal.SIGKILL)
                    killed.append(w)
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        got = asyncio.run(stream_all(system.grpc_address, requests()))
    finally:
        killer.join(70)
    assert killed, "no decode worker was seen decoding"
    assert [tokens(m) for m in got] == expected


def test_the_killed_worker_is_restarted_rejoins_and_serves(system, expected):
    deadline = time.monotonic() + 120
    while True:  # the restart registers at a new address; the router then health-checks it
        restarted = [w for w in system.workers("decode") if w["is_restart"]]
        if restarted and _healthy(restarted[0]["address"]):
            break
        assert time.monotonic() < deadline, system.workers()
        time.sleep(0.5)
    before = stats(restarted[0]["address"]).num_requests_total
    got = asyncio.run(stream_all(system.grpc_address, requests()))
    assert [tokens(m) for m in got] == expected
    assert stats(restarted[0]["address"]).num_requests_total > before


def _healthy(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_kill_9_of_a_prefill_worker_with_prefills_in_flight_loses_no_request(system, expected):
    """The victim is frozen first, so requests are sent to it and wait there; then killed."""
    victim = system.workers("prefill")[0]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        threading.Timer(1.0, os.kill, (victim["pid"], signal.SIGKILL)).start()
        got = asyncio.run(stream_all(system.grpc_address, requests()))
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert [tokens(m) for m in got] == expected


def test_scaling_up_and_down_under_load_loses_no_request(system, expected):
    results, stop = [], threading.Event()

    def load():
        while not stop.is_set():
            results.extend(asyncio.run(stream_all(system.grpc_address, requests()[:4])))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert "decode=3" in system.scale(decode=3)
        system.wait_workers(lambda ws: len([w for w in ws if w["role"] == "decode"]) == 3)
        time.sleep(2)
        assert "decode=1" in system.scale(decode=1)
        time.sleep(2)
    finally:
        stop.set()
        thread.join(300)
    assert results and all(tokens(m) == expected[i % 4] for i, m in enumerate(results))
    decode = system.workers("decode")
    assert len(decode) == 1
    deadline = time.monotonic() + 30
    for w in system.workers():  # every remaining worker holds no KV block after the load
        while (s := stats(w["address"], w["role"])).num_free_blocks != s.num_blocks or s.num_reserved or s.num_running:
            assert time.monotonic() < deadline, (w, s)
            time.sleep(0.2)


def test_scaling_beyond_the_cluster_says_what_is_missing(system):
    out = system.cli("scale", "--decode=9", timeout_s=200)
    assert out.returncode == 2 and out.stderr.startswith("pdserve: error: cannot place"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_routers_scale_only_where_their_ports_are_shared(system):
    out = system.cli("scale", "--routers=2")
    assert out.returncode == 2 and "start `pdserve serve` with router.processes above 1" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_without_the_ray_dashboard_none_of_its_modules_runs(system):
    """--no-ray-dashboard: the serve system in test_serve.py, started without it, answers `ray list
    actors` through those modules."""
    tree = [" ".join(p.cmdline()) for p in psutil.Process(system.proc.popen.pid).children(recursive=True)]
    assert any("gcs_server" in c for c in tree) and not any("ray-dashboard-" in c for c in tree), tree


def test_sigterm_stops_everything_it_started(system):
    tree = psutil.Process(system.proc.popen.pid).children(recursive=True)
    assert len(tree) > 5  # Ray's processes and the workers
    code, seconds = system.stop(timeout_s=90)
    assert code == 0, system.proc.log_tail()
    assert seconds < 60
    time.sleep(1)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]

"""Readiness follows the pools, seen from outside: a router whose only decode worker dies says
NOT_SERVING (gRPC health) and 503 (HTTP /ready), answers a request UNAVAILABLE at once naming
the missing pool, and says SERVING again once a decode worker is back at that address."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2 as gen
from procs import wait_ready

WORKER = ["--num-threads", "1", "--num-kv-blocks", "64", "--block-size", "8"]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _ready(http: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{http}/ready", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _until(what: str, predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:g} s"
        time.sleep(0.1)


def test_readiness_follows_the_only_decode_worker(cluster):
    decode = cluster.start("D6", "decode-worker", *WORKER)
    wait_ready(decode)
    address = decode.address
    # the router would queue for 300 s if it queued at all: UNAVAILABLE within the client's 20 s
    # deadline shows it answered without waiting
    router = cluster.start_router("R6", "--decode", address, "--http-port", "0", "--health-interval", "0.3",
                                  "--queue-timeout", "300", "--failover-wait", "300")
    wait_ready(router)
    channel = cluster.channel("R6")
    _until("SERVING", lambda: _health(channel) == SERVING)
    assert _health(channel, "pdserve.v1.Generation") == SERVING and _ready(router.addresses["http"])[0] == 200

    decode.popen.kill()
    decode.popen.wait(timeout=10)
    _until("NOT_SERVING", lambda: _health(channel) == NOT_SERVING)
    assert _health(channel, "pdserve.v1.Generation") == NOT_SERVING
    status, body = _ready(router.addresses["http"])
    assert status == 503 and body["reason"] == "no healthy decode worker", body
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.generation("R6").Generate(gen.GenerateRequest(
            prompt="anyone there?", sampling_params=gen.SamplingParams(max_tokens=2)), timeout=20))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "no healthy decode worker" in err.value.details()
    assert _health(channel) == NOT_SERVING  # liveness is /health; the process still answers

    back = cluster.start("D6b", "decode-worker", *WORKER, "--port", address.rsplit(":", 1)[1])
    wait_ready(back)
    _until("SERVING again", lambda: _health(channel) == SERVING)
    assert _ready(router.addresses["http"])[0] == 200
    msgs = list(cluster.generation("R6").Generate(gen.GenerateRequest(
        prompt="back again", sampling_params=gen.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        timeout=60))
    assert msgs[-1].finish_reason == gen.LENGTH
    router.stop()
    back.stop()

"""Standalone routers sharing their ports (`pdserve router --reuse-port`): two routers in front of
the shared cluster's P and D, on one gRPC and one HTTP port, each with its own /metrics; the
kernel spreads the connections over them and both serve what one router serves. A router that
would share the HTTP port without a metrics port of its own is refused in one line."""
from __future__ import annotations

import http.client
import subprocess
import sys
from pathlib import Path

import pytest

from procs import generate_all, joined, wait_ready
from pdserve.v1 import generation_pb2 as gen

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


@pytest.fixture
def pair(cluster):
    common = ["--prefill", cluster.address("P"), "--decode", cluster.address("D"), "--metrics-port", "0",
              "--reuse-port", "--health-interval", "0.5"]
    first = cluster.start_router("RA", *common, "--port", "0", "--http-port", "0")
    wait_ready(first)
    port, http_port = (first.addresses[k].rsplit(":", 1)[1] for k in ("grpc", "http"))
    second = cluster.start_router("RB", *common, "--port", port, "--http-port", http_port)
    try:
        wait_ready(second)
        yield first, second
    finally:
        for name in ("RB", "RA"):
            cluster.procs.pop(name).stop()


def _ok(cluster, name: str) -> float:
    return sum(v for (sample, labels), v in cluster.metrics(name).items()
               if sample == "pdserve:requests_total" and ("status", "ok") in labels)


def test_two_routers_on_one_port_split_the_connections(cluster, pair):
    first, second = pair
    assert first.addresses["grpc"] == second.addresses["grpc"] and first.addresses["http"] == second.addresses["http"]
    assert first.addresses["metrics"] != second.addresses["metrics"]
    conn = http.client.HTTPConnection(first.addresses["http"], timeout=10)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 404 and b"its own metrics port" in resp.read()  # it would mix the two routers'
    conn.close()
    reqs = [gen.GenerateRequest(token_ids=gen.TokenIds(ids=[5 + i, 6, 7]), sampling_params=gen.SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True)) for i in range(24)]
    want = [joined(m)[0] for m in generate_all(cluster, "R", reqs)]  # one router, the same workers
    got = generate_all(cluster, "RA", reqs, own_connections=True)
    assert [joined(m)[0] for m in got] == want
    served = [_ok(cluster, name) for name in ("RA", "RB")]
    assert sum(served) == len(reqs) and min(served) > 0, served  # all on one: odds of 2 in 2^24
    cluster.wait_all_free()


def test_sharing_the_http_port_needs_a_metrics_port_of_its_own(cluster):
    out = subprocess.run([PDSERVE, "router", "--model", str(cluster.model), "--decode", cluster.address("D"),
                          "--port", "0", "--http-port", "0", "--reuse-port"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "needs a --metrics-port" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1

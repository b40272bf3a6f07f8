"""The attacks from the hardening review, against `pdserve serve`, each refused: internal RPCs
without the cluster's credentials, transfer tickets that are guessed or forged, the public API
without a key or past its key's limits, Ray without its token."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from serve_system import serve_config, start_system

KEY, OTHER_KEY = "key-for-tests-0001", "key-for-tests-0002"
REQUEST = gen.GenerateRequest(prompt="def f(x):", sampling_params=gen.SamplingParams(temperature=0, max_tokens=4))


@pytest.fixture(scope="module")
def system(serving_model, tmp_path_factory):
    config = serve_config(serving_model, spec=False)
    config["security"] = {"api_keys": [KEY, OTHER_KEY], "api_key_max_concurrency": 1, "api_key_rate_limit": 2.0}
    s = start_system(tmp_path_factory.mktemp("security"), "security", config, "--no-ray-dashboard")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def workers(system):
    return {w["role"]: w for w in system.workers()}


def victim_ticket(system) -> str:
    """What a guessable ticket would be if tickets were request ids: the cmpl-… id the HTTP API
    hands out for a real request."""
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://{system.http_address}/v1/completions", body,
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["id"].removeprefix("cmpl-")


def test_internal_rpcs_refuse_callers_without_the_cluster_credentials(system, workers):
    decode, prefill = workers["decode"]["address"], workers["prefill"]["address"]
    work = worker_pb2.WorkRequest(req_id="attacker", prompt_token_ids=[5, 6, 7],
                                  sampling_params=gen.SamplingParams(max_tokens=2, seed=1))
    ticket = victim_ticket(system)
    with grpc.insecure_channel(decode) as d, grpc.insecure_channel(prefill) as p:
        dstub, pstub = worker_pb2_grpc.DecodeWorkerStub(d), worker_pb2_grpc.PrefillWorkerStub(p)
        attacks = {
            "push KV into a victim's reservation": lambda: dstub.PushKV(iter([worker_pb2.KVChunk(
                header=worker_pb2.KVHeader(ticket=ticket, num_tokens=1))]), timeout=10),
            "hold a reservation": lambda: next(dstub.Decode(work, timeout=10)),
            "run a request colocated": lambda: next(dstub.PrefillAndDecode(work, timeout=10)),
            "prefill into a victim's reservation": lambda: pstub.Prefill(worker_pb2.PrefillRequest(
                request=work, ticket=ticket), timeout=10),
            "read what a worker runs": lambda: dstub.GetInfo(worker_pb2.InfoRequest(), timeout=10),
            "read a worker's stats": lambda: pstub.GetStats(worker_pb2.StatsRequest(), timeout=10),
        }
        for what, attack in attacks.items():
            with pytest.raises(grpc.RpcError) as err:
                attack()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (what, err.value)
        # probes need no credentials
        for channel in (d, p):
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_public_api_needs_a_key(system):
    with grpc.insecure_channel(system.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong-key-000"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(REQUEST, timeout=30, metadata=metadata))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        msgs = list(stub.Generate(REQUEST, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),)))
        assert msgs[-1].finish_reason == gen.LENGTH
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(f"http://{system.http_address}/v1/completions", body), timeout=30)
    assert err.value.code == 401 and "API key" in json.loads(err.value.read())["error"]["message"]
    for path in ("/health", "/ready", "/metrics"):  # probes and scrapes need none
        with urllib.request.urlopen(f"http://{system.http_address}{path}", timeout=30) as resp:
            assert resp.status == 200


def test_each_key_is_limited_in_flight_and_in_rate(system):
    long = gen.GenerateRequest(prompt="x", sampling_params=gen.SamplingParams(max_tokens=200, ignore_eos=True))
    time.sleep(1.1)  # the earlier tests' requests are out of the rate window
    with grpc.insecure_channel(system.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = stub.Generate(long, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),))
        next(first)  # in flight now
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(REQUEST, timeout=30, metadata=(("authorization", f"Bearer {KEY}"),)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in err.value.details()
        # another key is not affected
        assert list(stub.Generate(REQUEST, timeout=60, metadata=(("authorization", f"Bearer {OTHER_KEY}"),)))
        first.cancel()
        refusals = []
        for _ in range(6):  # 2 per second with a burst of 2: quick calls run out
            try:
                list(stub.Generate(REQUEST, timeout=60, metadata=(("authorization", f"Bearer {OTHER_KEY}"),)))
            except grpc.RpcError as e:
                refusals.append(e)
        assert refusals and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refusals)
        assert "requests per second" in refusals[0].details()

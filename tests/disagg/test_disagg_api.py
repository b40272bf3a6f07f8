"""The public API's edges: bad input, reflection, health, and refusing mismatched workers."""
from __future__ import annotations

import grpc
import pytest

from procs import wait_ready
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from procs import MAX_PROMPT_CHARS
from pdserve.v1 import generation_pb2 as gen

OK = gen.SamplingParams(temperature=0, max_tokens=2)
BAD_REQUESTS = {
    "no input": (gen.GenerateRequest(sampling_params=OK), "prompt"),
    "empty prompt": (gen.GenerateRequest(prompt="", sampling_params=OK), "prompt"),
    "empty token ids": (gen.GenerateRequest(token_ids=gen.TokenIds(ids=[]), sampling_params=OK), "token_ids"),
    "unknown token ids": (gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 99999]), sampling_params=OK), "token_ids"),
    "prompt over context": (gen.GenerateRequest(token_ids=gen.TokenIds(ids=[7] * 600), sampling_params=OK), "token_ids"),
    "oversized prompt": (gen.GenerateRequest(prompt="a" * (MAX_PROMPT_CHARS + 1), sampling_params=OK), "prompt"),
    "oversized request id": (gen.GenerateRequest(request_id="r" * 300, prompt="hi", sampling_params=OK), "request_id"),
    "too many stop strings": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(stop=["x"] * 17)),
                              "sampling_params.stop"),
    "negative temperature": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(temperature=-1)),
                             "sampling_params.temperature"),
    "nan temperature": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(temperature=float("nan"))),
                        "sampling_params.temperature"),
    "top_p zero": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(top_p=0)), "sampling_params.top_p"),
    "negative top_k": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(top_k=-5)), "sampling_params.top_k"),
    "min_p over one": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(min_p=1.5)), "sampling_params.min_p"),
    "zero max_tokens": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(max_tokens=0)),
                        "sampling_params.max_tokens"),
    "unknown stop token": (gen.GenerateRequest(prompt="hi", sampling_params=gen.SamplingParams(stop_token_ids=[10**6])),
                           "sampling_params.stop_token_ids"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
@pytest.mark.parametrize("router", ["R", "R2"])
def test_bad_input_is_invalid_argument_naming_the_field(cluster, name, router):
    request, field = BAD_REQUESTS[name]
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.generation(router).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field), err.value.details()


def test_every_server_has_reflection_and_health(cluster):
    expected = {"R": "pdserve.v1.Generation", "P": "pdserve.v1.PrefillWorker", "D": "pdserve.v1.DecodeWorker"}
    for name, service in expected.items():
        services = set(ProtoReflectionDescriptorDatabase(cluster.channel(name)).get_services())
        assert {service, "grpc.health.v1.Health"} <= services, (name, services)


def test_mismatched_pair_is_refused_saying_what_differs(cluster):
    """D2 runs block size 8, P block size 16: a router given only those two must not start."""
    proc = cluster.start_router("R-mismatch", "--prefill", cluster.address("P"), "--decode", cluster.address("D2"),
                                "--connect-timeout", "30")
    assert proc.popen.wait(timeout=60) == 2
    log = proc.log.read_text()
    assert "refusing mismatched workers" in log and "block_size: prefill has 16, decode has 8" in log, log


def test_a_worker_that_fails_stops_getting_traffic(cluster):
    """A colocated router over D2 and a doomed D3 (more free blocks: the policy prefers it): once D3
    dies, every request still completes, on D2."""
    d3 = cluster.start("D3", "decode-worker", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "8")
    wait_ready(d3)
    r4 = cluster.start_router("R4", "--decode", f"{cluster.address('D2')},{d3.address}", "--health-interval", "0.3")
    wait_ready(r4)

    def serve(n: int) -> None:
        for i in range(n):
            msgs = list(cluster.generation("R4").Generate(gen.GenerateRequest(
                prompt=f"request {i}", sampling_params=gen.SamplingParams(temperature=0, max_tokens=3)), timeout=60))
            assert msgs[-1].finish_reason in (gen.LENGTH, gen.STOP)

    d2_before, d3_before = cluster.stats("D2").num_requests_total, cluster.stats("D3").num_requests_total
    serve(3)
    assert cluster.stats("D3").num_requests_total == d3_before + 3  # the preferred worker took them
    assert cluster.stats("D2").num_requests_total == d2_before
    d3.popen.kill()
    d3.popen.wait(timeout=10)
    serve(6)
    assert cluster.stats("D2").num_requests_total == d2_before + 6

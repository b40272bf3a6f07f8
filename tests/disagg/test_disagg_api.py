"""The public API's edges: bad input, reflection, health, and refusing mismatched workers."""
from __future__ import annotations

import grpc
import pytest

from types import SimpleNamespace

from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from procs import wait_ready

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


class V1ReflectionDatabase(ProtoReflectionDescriptorDatabase):
    """grpcio-reflection's client asks only `grpc.reflection.v1alpha`; this one asks only `v1`
    (the same messages under the name current clients such as grpcurl ask first)."""

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)
        self._stub = SimpleNamespace(ServerReflectionInfo=channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString))


EXPECTED_SERVICES = {"R": "pdserve.v1.Generation", "P": "pdserve.v1.PrefillWorker", "D": "pdserve.v1.DecodeWorker"}


@pytest.mark.parametrize("database", [ProtoReflectionDescriptorDatabase, V1ReflectionDatabase])
def test_every_server_has_reflection_and_health(cluster, database):
    """A client that knows nothing but reflection finds each service, its methods and their messages."""
    for name, service in EXPECTED_SERVICES.items():
        db = database(cluster.channel(name))
        services = set(db.get_services())
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= services, (name, services)
        described = DescriptorPool(db).FindServiceByName(service)
        assert "GetStats" in described.methods_by_name or "Generate" in described.methods_by_name, name
    pool = DescriptorPool(database(cluster.channel("R")))
    generate = pool.FindServiceByName("pdserve.v1.Generation").methods_by_name["Generate"]
    assert generate.server_streaming and "sampling_params" in generate.input_type.fields_by_name


def test_unimplemented_methods_answer_unimplemented_without_a_traceback(cluster):
    logs = {name: len(cluster.procs[name].log.read_text()) for name in EXPECTED_SERVICES}
    for name in EXPECTED_SERVICES:
        channel = cluster.channel(name)
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, (name, err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/pdserve.v1.Generation/NoSuchMethod")(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, name
    for name, start in logs.items():
        new = cluster.procs[name].log.read_text()[start:]
        assert "Traceback" not in new and "NotImplementedError" not in new, (name, new)


@pytest.mark.parametrize("servicer", ["GenerationServicer", "PrefillWorkerServicer", "DecodeWorkerServicer"])
def test_our_servicers_implement_every_method_of_their_service(servicer):
    """A method left to the generated base class would raise NotImplementedError (a traceback
    in the log) instead of answering."""
    from pdserve.decode_worker.server import DecodeWorkerServicer
    from pdserve.prefill_worker.server import PrefillWorkerServicer
    from pdserve.router.server import GenerationServicer
    from pdserve.v1 import generation_pb2_grpc, worker_pb2_grpc

    cls = {"GenerationServicer": GenerationServicer, "PrefillWorkerServicer": PrefillWorkerServicer,
           "DecodeWorkerServicer": DecodeWorkerServicer}[servicer]
    base = getattr(generation_pb2_grpc, servicer.replace("Servicer", "") + "Servicer", None) or \
        getattr(worker_pb2_grpc, servicer.removesuffix("Servicer") + "Servicer")
    methods = [m for m in vars(base) if not m.startswith("_")]
    assert methods and all(getattr(cls, m) is not getattr(base, m) for m in methods), methods


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

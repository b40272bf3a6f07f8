"""Property-based fuzzing of the public APIs of the shared real-process cluster: about a thousand
requests built from the proto's fields, mangled wire bytes, and OpenAI JSON bodies. Every one
is answered with a normal stream or a clear refusal (never UNKNOWN, INTERNAL or an HTTP 5xx),
no process logs a traceback, and the system serves and holds no block afterwards."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_cases import GOOD_CODES, GOOD_HTTP, generate_requests, http_bodies, raw_requests, send_grpc, send_http
from pdserve.v1 import generation_pb2 as gen

def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                    database=None)


@pytest.fixture(scope="module")
def router_channel(cluster):
    with grpc.insecure_channel(cluster.address("R")) as channel:
        yield channel
    # afterwards: no traceback anywhere, nothing held, and still serving
    for name in ("R", "P", "D"):
        assert "Traceback" not in cluster.procs[name].log.read_text(), cluster.procs[name].log_tail(60)
    cluster.wait_all_free()
    msgs = list(cluster.generation("R").Generate(gen.GenerateRequest(prompt="still here", sampling_params=gen.SamplingParams(
        temperature=0, max_tokens=3)), timeout=60))
    assert msgs[-1].finish_reason == gen.LENGTH


@fuzz(450)
@given(request=generate_requests())
def test_fuzzed_requests_get_clear_answers(router_channel, request):
    code = send_grpc(router_channel, request)
    assert code in GOOD_CODES, (code, request)


@fuzz(300)
@given(raw=raw_requests())
def test_fuzzed_wire_bytes_get_clear_answers(router_channel, raw):
    code = send_grpc(router_channel, raw)
    assert code in GOOD_CODES, (code, raw)


@fuzz(300)
@given(body=http_bodies())
def test_fuzzed_openai_bodies_get_clear_answers(router_channel, cluster, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status = send_http(cluster.http_address, path, body)
        assert status in GOOD_HTTP, (status, path, body[:300])

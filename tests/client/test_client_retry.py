"""Retries and connection options, against real gRPC servers made here: a port with nothing
listening, and a small `Generation` servicer whose answers each test scripts (fail with a code
n times, then stream; or stream a token, then fail), which also records what it was sent."""
from __future__ import annotations

import asyncio
import random
import socket
import subprocess
from concurrent import futures

import grpc
import pytest

from pdserve.client import (AsyncClient, Client, DeadlineExceededError, FinishReason, GenerationError,
                            InvalidArgumentError, RetryPolicy, UnavailableError)
from pdserve.client.channel import ConnectionOptions
from pdserve.client.retry import Attempts
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc

FAST = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the with block ends: nothing listens


class Scripted(generation_pb2_grpc.GenerationServicer):
    """Fails the first `num_failures` calls with `code`; then streams two deltas, or, with
    `fail_after_first`, one delta and then UNAVAILABLE."""

    def __init__(self, num_failures=0, code=grpc.StatusCode.UNAVAILABLE, fail_after_first=False):
        self.num_failures, self.code, self.fail_after_first = num_failures, code, fail_after_first
        self.calls: list[tuple[gen.GenerateRequest, dict]] = []

    def Generate(self, request, context):
        self.calls.append((request, dict(context.invocation_metadata())))
        if len(self.calls) <= self.num_failures:
            context.abort(self.code, f"scripted failure {len(self.calls)}")
        yield gen.GenerateResponse(request_id=request.request_id, token_ids=[7], text="a")
        if self.fail_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
        yield gen.GenerateResponse(request_id=request.request_id, token_ids=[8, 9], text="bc",
                                   finish_reason=gen.STOP, usage=gen.Usage(prompt_tokens=1, completion_tokens=3))


@pytest.fixture
def serve():
    servers = []

    def start(servicer, credentials=None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = (server.add_secure_port("localhost:0", credentials) if credentials
                else server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
        return f"{'localhost' if credentials else '127.0.0.1'}:{port}"

    yield start
    for s in servers:
        s.stop(0)


def test_unavailable_is_retried_a_bounded_number_of_times_then_fails():
    target = f"127.0.0.1:{closed_port()}"
    with Client(target, retry=FAST, timeout=10) as client:
        with pytest.raises(UnavailableError) as err:
            client.complete("x", max_tokens=1)
    assert err.value.attempts == 3 and err.value.code == grpc.StatusCode.UNAVAILABLE


def test_async_unavailable_is_retried_a_bounded_number_of_times_then_fails():
    async def run():
        async with AsyncClient(f"127.0.0.1:{closed_port()}", retry=FAST, timeout=10) as client:
            await client.complete("x", max_tokens=1)

    with pytest.raises(UnavailableError) as err:
        asyncio.run(run())
    assert err.value.attempts == 3


@pytest.mark.parametrize("is_async", [False, True])
def test_a_retry_succeeds_when_the_server_recovers(serve, is_async):
    servicer = Scripted(num_failures=2)
    target = serve(servicer)
    if is_async:
        async def run():
            async with AsyncClient(target, retry=FAST, timeout=10) as client:
                return await client.complete("x", request_id="same")
        out = asyncio.run(run())
    else:
        with Client(target, retry=FAST, timeout=10) as client:
            out = client.complete("x", request_id="same")
    assert (out.text, out.token_ids, out.finish_reason) == ("abc", [7, 8, 9], FinishReason.STOP)
    assert [req.request_id for req, _ in servicer.calls] == ["same"] * 3


@pytest.mark.parametrize("is_async", [False, True])
def test_no_retry_once_tokens_arrived(serve, is_async):
    servicer = Scripted(fail_after_first=True)
    target = serve(servicer)
    got = []

    async def run_async():
        async with AsyncClient(target, retry=FAST, timeout=10) as client:
            async for delta in client.generate("x"):
                got.append(delta.text)

    with pytest.raises(UnavailableError, match="worker died"):
        if is_async:
            asyncio.run(run_async())
        else:
            with Client(target, retry=FAST, timeout=10) as client:
                for delta in client.generate("x"):
                    got.append(delta.text)
    assert got == ["a"] and len(servicer.calls) == 1


def test_other_codes_are_not_retried(serve):
    servicer = Scripted(num_failures=5, code=grpc.StatusCode.INVALID_ARGUMENT)
    with Client(serve(servicer), retry=FAST) as client:
        with pytest.raises(InvalidArgumentError, match="scripted failure 1") as err:
            client.complete("x")
    assert len(servicer.calls) == 1 and isinstance(err.value, GenerationError)


def test_the_deadline_bounds_every_attempt_together():
    policy = RetryPolicy(max_attempts=1000, initial_backoff_s=0.05, max_backoff_s=0.05)
    with Client(f"127.0.0.1:{closed_port()}", retry=policy) as client:
        with pytest.raises((UnavailableError, DeadlineExceededError)) as err:
            client.complete("x", timeout=0.5)
    assert err.value.attempts < 1000  # the deadline, not the attempt budget, ended it


def test_backoff_is_jittered_below_its_cap():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.3, multiplier=2)
    rng = random.Random(0)
    for attempt, cap in ((1, 0.1), (2, 0.2), (3, 0.3), (9, 0.3)):
        waits = [policy.backoff_s(attempt, rng) for _ in range(200)]
        assert all(0 <= w <= cap for w in waits) and max(waits) > cap / 2 and len(set(waits)) > 100
    attempts = Attempts(policy, deadline=None)
    attempts.num_made = 1
    assert attempts.retry_after(grpc.StatusCode.INTERNAL) is None
    assert attempts.retry_after(grpc.StatusCode.UNAVAILABLE) is not None
    attempts.num_made = 3
    assert attempts.retry_after(grpc.StatusCode.UNAVAILABLE) is None
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_api_key_and_metadata_travel_with_every_call(serve):
    servicer = Scripted()
    with Client(serve(servicer), api_key="sekret", metadata={"x-team": "search"}) as client:
        client.complete("x")
    _, metadata = servicer.calls[0]
    assert metadata["authorization"] == "Bearer sekret" and metadata["x-team"] == "search"
    with pytest.raises(ValueError, match="authorization"):
        Client("h:1", api_key="k", metadata={"authorization": "Bearer other"})
    with pytest.raises(ValueError, match="target"):
        Client("nohostport")


def test_tls_with_root_certificates_from_a_path(serve, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    target = serve(Scripted(), credentials=creds)
    with Client(target, root_certificates=str(cert), timeout=10) as client:
        assert client.complete("x").text == "abc"
    with Client(target, retry=FAST, timeout=10) as plain:  # a plaintext client cannot talk to it
        with pytest.raises(UnavailableError):
            plain.complete("x")
    with pytest.raises(ValueError, match="root_certificates"):
        ConnectionOptions.build(target, root_certificates=tmp_path / "missing.pem")

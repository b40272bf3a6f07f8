"""Real worker and router processes for the serving tests (`pdserve.cluster.local`), and the
helpers the tests use to talk to them."""
from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from pdserve.cluster.local import LocalProcess, ProcessFailed
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

START_TIMEOUT_S = 120.0
CLUSTER_TOKEN = "test-cluster-secret-0123456789"  # every process of the shared cluster runs with it
NUM_KV_BLOCKS = 128
MAX_NUM_SEQS = 32
MAX_PROMPT_CHARS = 5000


def wait_ready(*procs: LocalProcess) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait_ready(max(1.0, deadline - time.monotonic()))
        except ProcessFailed as e:
            pytest.fail(str(e))


class _WithClusterToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Test channels to the workers present the cluster's credentials, as the router does."""

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), ("pdserve-cluster-token", CLUSTER_TOKEN)])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


@dataclass
class Cluster:
    model: Path
    logs: Path
    procs: dict[str, LocalProcess] = field(default_factory=dict)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def address(self, name: str) -> str:
        return self.procs[name].address

    @property
    def http_address(self) -> str:
        """Router R's OpenAI-compatible HTTP API."""
        return self.procs["R"].addresses["http"]

    def channel(self, name: str, credentials: bool = True) -> grpc.Channel:
        """To a process; with the cluster's credentials unless asked not to."""
        key = (name, credentials)
        if key not in self.channels:
            channel = grpc.insecure_channel(self.address(name))
            self.channels[key] = grpc.intercept_channel(channel, _WithClusterToken()) if credentials else channel
        return self.channels[key]

    def generation(self, router: str = "R") -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel(router))

    def decode_stub(self, name: str = "D") -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(name))

    def stats(self, name: str) -> worker_pb2.WorkerStats:
        stub = (worker_pb2_grpc.PrefillWorkerStub if name.startswith("P") else worker_pb2_grpc.DecodeWorkerStub)
        return stub(self.channel(name)).GetStats(worker_pb2.StatsRequest(), timeout=5)

    def wait_all_free(self, names=("P", "D", "D2"), timeout_s: float = 15.0) -> None:
        """Until every block of every named worker is free and nothing is reserved or running."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = {n: self.stats(n) for n in names}
            if all(s.num_free_blocks == s.num_blocks and s.num_reserved == 0 and s.num_running == 0
                   for s in stats.values()):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"blocks still held after {timeout_s:g} s: {stats}")
            time.sleep(0.1)

    def start(self, name: str, command: str, *args: str, model: bool = True) -> LocalProcess:
        """Another process (stopped at teardown); wait for it with `wait_ready`."""
        extra = ["--model", str(self.model)] if model else []
        proc = LocalProcess(name, command, [*extra, *args], self.logs / f"{name}.log",
                            env={"PDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN})
        self.procs[name] = proc
        return proc.start()

    def start_router(self, name: str, *args: str) -> LocalProcess:
        return self.start(name, "router", *args)

    def stop(self) -> None:
        for ch in self.channels.values():
            ch.close()
        for proc in reversed(list(self.procs.values())):
            proc.stop()

    def metrics(self, name: str) -> dict[tuple[str, frozenset], float]:
        """A process's /metrics as {(sample name, labels without model_name/worker): value}."""
        from urllib.request import urlopen

        from prometheus_client.parser import text_string_to_metric_families

        with urlopen(f"http://{self.procs[name].addresses['metrics']}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "worker"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


async def _generate_all(address: str, requests: list[gen.GenerateRequest],
                        own_connections: bool = False) -> list[list[gen.GenerateResponse]]:
    """Each request's messages, over one connection (or a connection each: `own_connections`)."""
    async def one(channel, req):
        return [m async for m in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=120)]

    async def alone(req):
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            return await one(channel, req)

    if own_connections:
        return await asyncio.gather(*(alone(r) for r in requests))
    async with grpc.aio.insecure_channel(address) as channel:
        return await asyncio.gather(*(one(channel, r) for r in requests))


def generate_all(cluster, router: str, requests, own_connections: bool = False) -> list[list[gen.GenerateResponse]]:
    return asyncio.run(_generate_all(cluster.address(router), requests, own_connections))


def joined(msgs: list[gen.GenerateResponse]) -> tuple[list[int], str]:
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def greedy_tokens(cluster, router: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    """One greedy request through a router: its tokens."""
    msgs = list(cluster.generation(router).Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt), sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True)), timeout=60))
    return [t for m in msgs for t in m.token_ids]


def unique_prompt(req_id: str, prompt: list[int]) -> list[int]:
    """`prompt` with its first token made the request's own: a hand-made push covers every token,
    so the decode worker must hold none of them (its prefix cache keeps what earlier pushes of the
    same prompt wrote). Deterministic: a clash would fail the same way every run."""
    return [1 + zlib.crc32(req_id.encode()) % 97, *prompt[1:]]


def reserve(cluster, decode: str, req_id: str, prompt: list[int]):
    """A reservation on a decode worker for a hand-made push of every token of `prompt` (its first
    token made the request's own, `unique_prompt`): its event stream and its ticket."""
    from pdserve.v1 import worker_pb2 as wk

    stream = cluster.decode_stub(decode).Decode(wk.WorkRequest(
        req_id=req_id, prompt_token_ids=unique_prompt(req_id, prompt),
        sampling_params=gen.SamplingParams(temperature=0, max_tokens=3, seed=1)), timeout=60)
    event = next(stream)
    assert event.WhichOneof("event") == "admitted"
    assert event.admitted.num_cached_tokens == 0
    return stream, event.admitted.ticket


"""Real worker and router processes for the serving tests: start, wait for SERVING, stop."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
PDSERVE = str(Path(sys.executable).with_name("pdserve"))  # the installed command, as users run it
START_TIMEOUT_S = 120.0
NUM_KV_BLOCKS = 128
MAX_NUM_SEQS = 32
MAX_PROMPT_CHARS = 5000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    address: str = ""
    metrics_address: str = ""  # where it serves Prometheus /metrics, if it does
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "w") as f:
            self.popen = subprocess.Popen([PDSERVE, *self.args], env=env,
                                          stdout=f, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text().splitlines()[-n:])

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)


def wait_serving(proc: Proc, deadline: float) -> None:
    with grpc.insecure_channel(proc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.popen.poll() is not None:
                pytest.fail(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{proc.name} not SERVING within {START_TIMEOUT_S:g} s:\n{proc.log_tail()}")
            time.sleep(0.2)


@dataclass
class Cluster:
    model: Path
    http_address: str = ""  # router R's OpenAI-compatible HTTP API
    procs: dict[str, Proc] = field(default_factory=dict)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def address(self, name: str) -> str:
        return self.procs[name].address

    def channel(self, name: str) -> grpc.Channel:
        if name not in self.channels:
            self.channels[name] = grpc.insecure_channel(self.address(name))
        return self.channels[name]

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

    def start(self, name: str, command: str, *args: str) -> Proc:
        """Another process (stopped at teardown), for tests that need one of their own; not waited for."""
        proc = Proc(name, [command, "--model", str(self.model), "--port", str(port := free_port()), *args],
                    self.procs["P"].log.parent / f"{name}.log", f"127.0.0.1:{port}")
        self.procs[name] = proc
        proc.start()
        return proc

    def start_router(self, name: str, *args: str) -> Proc:
        return self.start(name, "router", *args)

    def metrics(self, name: str) -> dict[tuple[str, frozenset], float]:
        """A process's /metrics as {(sample name, labels without model_name/worker): value}."""
        from urllib.request import urlopen

        from prometheus_client.parser import text_string_to_metric_families

        with urlopen(f"http://{self.procs[name].metrics_address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "worker"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}



"""`pdserve serve` as a test drives it: a real process on a real local Ray (embedded, or joining a
cluster), its status and scale commands, and its workers' processes to kill."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml

from pdserve.cluster.local import PDSERVE, LocalProcess
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc


def serve_config(model: Path, *, prefill: int = 1, decode: int = 1, cpus: float = 0.5, spec: bool = True,
                 **extra) -> dict:
    """A small system on the tiny test model (drafting for itself at a fixed depth, so seeded
    sampling is a pure function of the seed whatever the batch)."""
    engine = {"num_kv_blocks": 128, "max_num_seqs": 32, "spec_adaptive": False}
    return {"model": str(model), "draft_model": str(model) if spec else None, "num_speculative_tokens": 3 if spec else 0,
            "prefill": {"workers": prefill, "cpus": cpus, "engine": {"num_kv_blocks": 128}},
            "decode": {"workers": decode, "cpus": cpus, "engine": engine},
            "router": {"grpc_port": 0, "http_port": 0, "drain_timeout": 5, "health_interval": 0.5,
                       "failover_wait": 60},
            "placement_timeout": 60, **extra}


@dataclass
class ServeSystem:
    proc: LocalProcess
    runtime_dir: Path

    @property
    def env(self) -> dict:
        return {**os.environ, "PDSERVE_RUNTIME_DIR": str(self.runtime_dir)}

    def cli(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([PDSERVE, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def status(self) -> dict:
        out = self.cli("status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def workers(self, role: str | None = None) -> list[dict]:
        return [w for w in self.status()["workers"] if role is None or w["role"] == role]

    def wait_workers(self, predicate, timeout_s: float = 120) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while not predicate(workers := self.workers()):
            assert time.monotonic() < deadline, f"workers never became as expected: {workers}"
            time.sleep(0.5)
        return workers

    def scale(self, **counts: int) -> str:
        out = self.cli("scale", *(f"--{k}={v}" for k, v in counts.items()), timeout_s=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    @property
    def grpc_address(self) -> str:
        return self.proc.addresses["grpc"]

    @property
    def http_address(self) -> str:
        return self.proc.addresses["http"]

    def stop(self, timeout_s: float = 60) -> tuple[int | None, float]:
        start = time.monotonic()
        code = self.proc.stop(timeout_s)
        return code, time.monotonic() - start


def start_system(tmp_path: Path, name: str, config: dict, *args: str, env: dict | None = None) -> ServeSystem:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    runtime = tmp_path / f"{name}-run"
    runtime.mkdir()
    proc = LocalProcess(name, "serve", ["--config", str(path), *args], tmp_path / f"{name}.log",
                        env={"PDSERVE_RUNTIME_DIR": str(runtime), **(env or {})})
    system = ServeSystem(proc.start(), runtime)
    proc.wait_ready(240)
    return system


# ---- clients --------------------------------------------------------------------------------
async def stream_all(address: str, requests: list[gen.GenerateRequest],
                     timeout_s: float = 180) -> list[list[gen.GenerateResponse] | grpc.aio.AioRpcError]:
    """Each request's messages (or its error)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(req):
            try:
                return [m async for m in stub.Generate(req, timeout=timeout_s)]
            except grpc.aio.AioRpcError as e:
                return e

        return await asyncio.gather(*(one(r) for r in requests))


def tokens(msgs) -> list[int]:
    assert not isinstance(msgs, Exception), msgs
    return [t for m in msgs for t in m.token_ids]

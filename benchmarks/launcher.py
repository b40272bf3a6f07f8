"""A small local launcher for the benchmarks: start pdserve worker and router processes with the
installed `pdserve` command, each pinned to the cores given, wait until gRPC health says
SERVING, stop them all at the end. Kept in this one module so the benchmarks can switch to the
shared launcher (`pdserve.cluster.local`) when it lands.

    with Launcher(log_dir) as run:
        p = run.prefill("P", ["--model", "models/demo"], cpus=[0])
        d = run.decode("D", ["--model", "models/demo"], cpus=[1])
        r = run.router("R", "models/demo", prefill=[p], decode=[d])
        run.wait_ready()
        ... r.address (gRPC), r.http_address, r.metrics_address ...
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PDSERVE = str(Path(sys.executable).with_name("pdserve"))
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    name: str
    args: list[str]
    cpus: list[int] | None
    log: Path
    address: str
    metrics_address: str
    http_address: str = ""
    popen: subprocess.Popen | None = None

    def start(self, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        cpus = self.cpus
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(self.log, "w") as f:
            self.popen = subprocess.Popen([PDSERVE, *self.args], env=env, stdout=f, stderr=subprocess.STDOUT,
                                          preexec_fn=pin)

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=15)

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@dataclass
class Launcher:
    log_dir: Path
    threads: int = 1  # torch threads per worker
    procs: list[Process] = field(default_factory=list)

    def __enter__(self) -> "Launcher":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, name: str, args: list[str], cpus: list[int] | None, threads: int | None = None) -> Process:
        port, metrics = free_port(), free_port()
        proc = Process(name, [*args, "--port", str(port), "--metrics-port", str(metrics)], cpus,
                       self.log_dir / f"{name}.log", f"127.0.0.1:{port}", f"127.0.0.1:{metrics}")
        proc.start(threads or self.threads)
        self.procs.append(proc)
        return proc

    def worker(self, role: str, name: str, args: list[str], cpus: list[int] | None) -> Process:
        """role: prefill-worker or decode-worker; args: everything but ports and threads."""
        return self._start(name, [role, *args, "--num-threads", str(self.threads)], cpus)

    def router(self, name: str, model: str, prefill: list[Process], decode: list[Process],
               cpus: list[int] | None = None, extra: list[str] = ()) -> Process:
        http = free_port()
        args = ["router", "--model", model, "--decode", ",".join(p.address for p in decode),
                "--http-port", str(http), *extra]
        if prefill:
            args += ["--prefill", ",".join(p.address for p in prefill)]
        proc = self._start(name, args, cpus, threads=1)
        proc.http_address = f"127.0.0.1:{http}"
        return proc

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every process answers SERVING on grpc.health.v1; RuntimeError with its log if one dies."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with grpc.insecure_channel(proc.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    if proc.popen.poll() is not None:
                        raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                        if status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{proc.name} not SERVING within {timeout_s:g} s:\n{proc.tail()}")
                    time.sleep(0.2)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


def scrape(metrics_address: str) -> dict[str, float]:
    """A process's /metrics, unlabelled samples by name (labels dropped; sums over label sets)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" not in s.labels and "position" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out

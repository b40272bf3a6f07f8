"""The benchmarks' handle on `pdserve.cluster.local`: worker and router processes started with
the installed `pdserve` command, each pinned to the cores given and with the torch threads
given, waited for by their ready lines, stopped together at the end.

    with Launcher(log_dir) as run:
        p = run.worker("prefill-worker", "P", ["--model", "models/demo"], cpus=[0])
        d = run.worker("decode-worker", "D", ["--model", "models/demo"], cpus=[1])
        r = run.router("R", "models/demo", prefill=[p], decode=[d])
        run.wait_ready()
        ... r.address (gRPC), r.http_address, r.metrics_address ...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster.local import LocalProcess

START_TIMEOUT_S = 180.0


class Process(LocalProcess):
    @property
    def http_address(self) -> str:
        return self.addresses.get("http", "")

    @property
    def metrics_address(self) -> str:
        return self.addresses.get("metrics", "")


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

    def _start(self, name: str, command: str, args: list[str], cpus: list[int] | None, threads: int,
               env: dict | None = None) -> Process:
        proc = Process(name, command, [*args, "--metrics-port", "0"], self.log_dir / f"{name}.log",
                       tuple(cpus) if cpus else None, env={"OMP_NUM_THREADS": str(threads), **(env or {})})
        self.procs.append(proc)
        return proc.start()

    def worker(self, role: str, name: str, args: list[str], cpus: list[int] | None, env: dict | None = None) -> Process:
        """role: prefill-worker or decode-worker; args: everything but ports and threads."""
        return self._start(name, role, [*args, "--num-threads", str(self.threads)], cpus, self.threads, env)

    def router(self, name: str, model: str, prefill: list[Process], decode: list[Process],
               cpus: list[int] | None = None, extra: list[str] = (), env: dict | None = None) -> Process:
        """Starts once its workers are ready (it needs the ports they bound)."""
        for proc in (*prefill, *decode):
            proc.wait_ready(START_TIMEOUT_S)
        args = ["--model", model, "--decode", ",".join(p.address for p in decode), "--http-port", "0", *extra]
        if prefill:
            args += ["--prefill", ",".join(p.address for p in prefill)]
        return self._start(name, "router", args, cpus, 1, env)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every process printed its ready line; ProcessFailed with its log if one dies."""
        for proc in self.procs:
            proc.wait_ready(timeout_s)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


def samples(metrics_address: str) -> list:
    """A process's /metrics, every sample (name, labels, value) as prometheus_client parses them."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(metrics_address: str) -> dict[str, float]:
    """A process's /metrics, unlabelled samples by name (labels dropped; sums over label sets)."""
    out: dict[str, float] = {}
    for s in samples(metrics_address):
        if "le" not in s.labels and "position" not in s.labels:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out

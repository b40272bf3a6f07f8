"""Standalone pdserve processes on this machine, without Ray: start one, wait for its ready
line, read the addresses it bound, stop it. What the tests, the benchmarks and `pdserve bench`'s
comparisons use to run the serving path as real processes.

Every process binds port 0 (a free port, chosen by the kernel at bind time, so two processes
never race for one) and prints `pdserve <command> ready: grpc=HOST:PORT [http=…] [metrics=…]`
once it serves; `LocalProcess.addresses` holds those.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PDSERVE = str(Path(sys.executable).with_name("pdserve"))  # the installed command, as users run it


class ProcessFailed(RuntimeError):
    pass


@dataclass
class LocalProcess:
    """`pdserve <command> <args>`; `cpus` pins it (and its threads) to those cores."""

    name: str
    command: str
    args: list[str]
    log: Path
    cpus: tuple[int, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return self.addresses["grpc"]

    def start(self) -> LocalProcess:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **self.env}
        ports = ["--port", "0"] if self.command in ("router", "prefill-worker", "decode-worker") else []
        with open(self.log, "w") as f:
            self.popen = subprocess.Popen([PDSERVE, self.command, *ports, *self.args], env=env, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=self._pin if self.cpus else None)
        return self

    def _pin(self) -> None:
        os.sched_setaffinity(0, self.cpus)

    def wait_ready(self, timeout_s: float = 120.0) -> LocalProcess:
        """Until the ready line appears; ProcessFailed (with the log's tail) if the process exits
        or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        marker = "pdserve ready: " if self.command == "serve" else f"pdserve {self.command} ready: "
        while True:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(marker):
                    self.addresses = dict(kv.split("=", 1) for kv in line[len(marker):].split())
                    return self
            if self.popen.poll() is not None:
                raise ProcessFailed(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ProcessFailed(f"{self.name} not ready within {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; its exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        return self.popen.returncode

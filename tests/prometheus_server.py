"""A real Prometheus server (Debian's `prometheus` package) on loopback for the tests: start it
on a scrape config, query its HTTP API, stop it. `make test` installs the package when it is
missing and may (as root); elsewhere the tests that need it are skipped, saying so."""
from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

MISSING = ("Debian's `prometheus` package is not installed (`make test` installs it when run as root: "
           "apt-get install prometheus)")


def require(tool: str) -> str:
    """The path of `prometheus` or `promtool`, or skip the test saying why."""
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not found: {MISSING}")
    return path


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require("promtool"), *args], capture_output=True, text=True, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Prometheus:
    proc: subprocess.Popen
    address: str
    log: Path

    @classmethod
    def start(cls, config: dict, workdir: Path, timeout_s: float = 30.0) -> Prometheus:
        """Prometheus on 127.0.0.1 with `config` (a dict, written as YAML) and its storage in `workdir`."""
        import yaml

        binary = require("prometheus")
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        address, log = f"127.0.0.1:{_free_port()}", workdir / "prometheus.log"
        with open(log, "w") as f:
            proc = subprocess.Popen([binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
                                     f"--web.listen-address={address}", "--log.level=warn"],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(proc, address, log)
        deadline = time.monotonic() + timeout_s
        while not server.is_ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                pytest.fail(f"prometheus did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        return server

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict | list:
        """GET /api/v1/<path>: its `data` (AssertionError with Prometheus' error otherwise)."""
        url = f"http://{self.address}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        assert body.get("status") == "success", (params, body.get("errorType"), body.get("error"))
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result as a vector (a scalar becomes one sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", data
        return data["result"]

    def finite_values(self, expr: str) -> list[float]:
        return [v for s in self.query(expr) if math.isfinite(v := float(s["value"][1]))]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

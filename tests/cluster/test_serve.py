"""`pdserve serve` on a real local Ray: it starts, serves what the offline engine computes, keeps
its Ray private, and stops cleanly. The faults (kill -9, scaling) are in test_failover.py."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request

import psutil
import pytest

from pdserve.engine import SamplingParams
from pdserve.v1 import generation_pb2 as gen
from serve_system import serve_config, start_system, stream_all, tokens

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "héllo wörld", "class Foo:\n    pass", "x = [1, 2"]


@pytest.fixture(scope="module")
def system(serving_model, tmp_path_factory):
    # a RAY_ADDRESS in the environment must not pull the embedded Ray into another cluster
    s = start_system(tmp_path_factory.mktemp("serve"), "serve", serve_config(serving_model, decode=2),
                     "--served-model-name", "tiny", env={"RAY_ADDRESS": "127.0.0.1:1"})
    yield s
    s.stop()


def test_serves_what_the_offline_engine_computes(system, offline):
    requests = [gen.GenerateRequest(prompt=p, sampling_params=gen.SamplingParams(temperature=0, max_tokens=20,
                                                                                ignore_eos=True)) for p in PROMPTS]
    got = asyncio.run(stream_all(system.grpc_address, requests))
    want = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [tokens(m) for m in got] == [w.token_ids for w in want]
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "ignore_eos": True}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://{system.http_address}/v1/completions", body),
                                timeout=60) as resp:
        assert json.loads(resp.read())["choices"][0]["text"] == want[0].text
    with urllib.request.urlopen(f"http://{system.http_address}/ready", timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(f"http://{system.http_address}/v1/models", timeout=10) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny"]  # --served-model-name


def test_status_lists_every_worker_by_pool(system):
    workers = system.workers()
    assert sorted(w["worker_id"] for w in workers) == ["decode-0", "decode-1", "prefill-0"]
    assert {w["role"] for w in workers} == {"prefill", "decode"}
    assert all(w["address"].startswith("127.0.0.1:") and w["metrics_address"] for w in workers)
    targets = json.loads(open(system.proc.addresses["targets"]).read())  # Prometheus file-SD
    assert {g["labels"]["pdserve_role"] for g in targets} == {"router", "prefill", "decode"}
    assert sorted(t for g in targets for t in g["targets"] if g["labels"]["pdserve_role"] != "router") == \
        sorted(w["metrics_address"] for w in workers)
    # the same list for Prometheus' HTTP service discovery, from the router's HTTP API
    with urllib.request.urlopen(f"http://{system.http_address}/prometheus/targets", timeout=10) as resp:
        assert json.loads(resp.read()) == targets


def test_ray_list_actors_shows_which_pool_each_actor_is(system):
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "list", "actors", "--format", "json",
                          "--address", system.proc.addresses["ray"]], env=_ray_env(system), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = {a["name"] for a in json.loads(out.stdout) if a["state"] == "ALIVE"}
    assert {"pdserve-prefill-0", "pdserve-decode-0", "pdserve-decode-1", "pdserve-controller"} <= names


def _ray_env(system) -> dict:
    info = json.loads((system.runtime_dir / "serve.json").read_text())
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": info["token"]}


def test_embedded_ray_is_private_loopback_only_and_needs_its_token(system):
    info = json.loads((system.runtime_dir / "serve.json").read_text())
    assert info["embedded"] and info["address"].startswith("127.0.0.1:")
    assert oct((system.runtime_dir / "serve.json").stat().st_mode & 0o777) == "0o600"
    tree = [psutil.Process(system.proc.popen.pid), *psutil.Process(system.proc.popen.pid).children(recursive=True)]
    listening = {(c.laddr.ip, c.laddr.port) for p in tree for c in _connections(p) if c.status == psutil.CONN_LISTEN}
    assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in listening), listening
    # a caller without the cluster's token is refused by Ray's own control plane (any GCS method)
    import grpc

    with grpc.insecure_channel(info["address"]) as channel:
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo")
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value


def _connections(p: psutil.Process):
    try:
        return p.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


# ---- configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    ({"decode.workers": 0}, "decode.workers must be an integer >= 1, got 0"),
    ({"prefill.cpus": -1}, "prefill.cpus must be a number > 0, got -1"),
    ({"prefill.cpus": "a lot"}, "prefill.cpus must be a number > 0"),
    ({"router.grpc_port": 70000}, "router.grpc_port must be a port"),
    ({"router.drain_timeout": 0}, "router.drain_timeout must be a number > 0"),
    ({"decode.engine": {"block_size": 0}}, "decode.engine.block_size must be >= 1"),
    ({"decode.engine": {"blocksize": 8}}, "decode.engine has unknown options"),
    ({"model": "/nonexistent"}, "model must be a checkpoint directory"),
    ({"local_prefill_tokens": -1}, "local_prefill_tokens must be an integer >= 0, got -1"),
    ({"local_prefill_tokens": True}, "local_prefill_tokens must be an integer >= 0, got True"),
    ({"decode.engine": {"prefill_chunk_tokens": -8}},
     "decode.engine.prefill_chunk_tokens must be an integer >= 0 or None, got -8"),
    ({"local_prefill_chunk_tokens": -1}, "local_prefill_chunk_tokens must be an integer >= 0 or null, got -1"),
    ({"stream_interval": 0}, "stream_interval must be an integer >= 1, got 0"),
    ({"router.processes": 0}, "router.processes must be an integer >= 1, got 0"),
    ({"router.processes": 1.5}, "router.processes must be an integer >= 1, got 1.5"),
    ({"router.token_streams": "yes"}, "router.token_streams must be true or false, got 'yes'"),
    ({"colour": "blue"}, "unknown field colour"),
    ({"router.port": 1}, "unknown field router.port"),
])
def test_bad_config_names_the_field(serving_model, overrides, message):
    from pdserve.cluster.config import load

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(None, {"model": str(serving_model), "draft_model": None, **overrides})


def test_config_file_then_flags(serving_model, tmp_path):
    from pdserve.cluster.config import load

    path = tmp_path / "c.yaml"
    path.write_text(f"model: {serving_model}\ndraft_model: null\ndecode:\n  workers: 3\n  engine:\n    max_num_seqs: 8\n")
    config = load(str(path), {"decode.workers": 2, "router.http_port": 0})
    assert (config.decode.workers, config.decode.engine, config.router.http_port) == (2, {"max_num_seqs": 8}, 0)
    assert config.engine_config("decode").max_num_seqs == 8 and config.is_disaggregated
    path.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load(str(path), {})


def test_cli_reports_a_bad_config_and_a_taken_port_in_one_line(serving_model, tmp_path):
    import socket

    from pdserve.cluster.local import PDSERVE

    out = subprocess.run([PDSERVE, "serve", "--model", str(serving_model), "--decode-workers", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == "pdserve: error: decode.workers must be an integer >= 1, got 0"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([PDSERVE, "serve", "--model", str(serving_model), "--grpc-port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Ray" not in out.stderr


def failed_start(tmp_path, name: str, config: dict) -> str:
    """`pdserve serve` on `config`, which must fail: it exits 2 without ever saying ready. Its log."""
    from pdserve.cluster.local import LocalProcess, ProcessFailed

    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    proc = LocalProcess(name, "serve", ["--config", str(path), "--no-ray-dashboard"], tmp_path / f"{name}.log",
                        env={"PDSERVE_RUNTIME_DIR": str(tmp_path)}).start()
    with pytest.raises(ProcessFailed):
        proc.wait_ready(300)
    assert proc.popen.wait(60) == 2
    return proc.log.read_text()


def test_a_placement_that_cannot_be_satisfied_fails_saying_what_is_missing(serving_model, tmp_path):
    config = serve_config(serving_model, decode=1, spec=False, placement_timeout=3)
    config["decode"]["gpus"] = 1  # there is no GPU here
    log = failed_start(tmp_path, "nogpu", config)
    assert "cannot place 1 decode worker of {'CPU': 0.5, 'GPU': 1} each" in log and "GPU 0" in log, log[-2000:]
    assert "worker: loading" not in log  # both pools are placed before any worker starts


def test_a_worker_that_cannot_load_its_model_fails_the_start_saying_why(serving_model, tmp_path):
    """A checkpoint the config check cannot see is broken (a tensor missing) fails in the workers:
    `pdserve serve` exits 2 with the worker's reason as soon as the first worker fails, well
    before the start timeout."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "broken"
    shutil.copytree(serving_model, model)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, model / "model.safetensors")
    log = failed_start(tmp_path, "broken", {**serve_config(model, spec=False), "start_timeout": 600})
    error = [line for line in log.splitlines() if line.startswith("pdserve: error:")]
    assert len(error) == 1 and re.fullmatch(r"pdserve: error: worker (prefill|decode)-0 failed to start: "
                                            r"\S+/broken: checkpoint lacks tensors \['model.norm.weight'\]", error[0]), error
    assert "Traceback" not in log  # a bad checkpoint is the input's fault: one line each, no stack


def test_the_documented_config_file_is_the_defaults():
    """deploy/pdserve.yaml documents every field with its default value."""
    import dataclasses
    from pathlib import Path

    import yaml

    from pdserve.cluster.config import REPO, ServeConfig, load

    path = REPO / "deploy" / "pdserve.yaml"
    loaded, defaults = load(str(path), {}), ServeConfig()
    assert dataclasses.replace(loaded, model=defaults.model, draft_model=defaults.draft_model) == defaults
    assert Path(loaded.model).resolve() == Path(defaults.model).resolve()
    raw = yaml.safe_load(path.read_text())
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    assert set(raw) == fields
    for section in ("router", "security", "prefill", "decode"):
        assert set(raw[section]) == {f.name for f in dataclasses.fields(type(getattr(defaults, section)))}


# ---- Prometheus, the dashboard and the alerts against this system ---------------------------
def dashboard_queries(variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of deploy/grafana/pdserve.json, with the template
    variables substituted as Grafana would."""
    import re

    from pdserve.cluster.config import REPO

    dashboard = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], target["expr"])
            out.append((panel["title"], expr))
    return out


def _traffic(address: str, stop) -> None:
    """Small greedy requests, two at a time, until `stop` is set."""
    import grpc

    from pdserve.v1 import generation_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        i = 0
        while not stop.is_set():
            i += 1
            request = gen.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], sampling_params=gen.SamplingParams(
                temperature=0, max_tokens=4 + i % 8, ignore_eos=True))
            for _ in stub.Generate(request, timeout=60):
                pass


def test_prometheus_scrapes_the_file_sd_targets_and_every_dashboard_query_returns_data(system, tmp_path):
    """A real Prometheus, fed only `pdserve serve`'s file-SD targets file, scrapes every process;
    under a little traffic every panel's query of the Grafana dashboard parses and returns a
    number, and every alert rule evaluates without error."""
    import threading
    import time

    from pdserve.cluster.config import REPO
    from prometheus_server import Prometheus

    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(REPO / "deploy" / "prometheus" / "alerts.yml")],
              "scrape_configs": [{"job_name": "pdserve", "honor_labels": True, "file_sd_configs": [
                  {"files": [system.proc.addresses["targets"]], "refresh_interval": "1s"}]}]}
    prom = Prometheus.start(config, tmp_path)
    stop = threading.Event()
    senders = [threading.Thread(target=_traffic, args=(system.grpc_address, stop), daemon=True) for _ in range(2)]
    try:
        for t in senders:
            t.start()
        deadline = time.monotonic() + 45
        while sorted(s["metric"]["pdserve_role"] for s in prom.query('up{job="pdserve"} == 1')) != \
                ["decode", "decode", "prefill", "router"]:
            assert time.monotonic() < deadline, prom.query("up")
            time.sleep(0.5)
        (model,) = prom.api("label/model_name/values", **{"match[]": "pdserve:time_to_first_token_seconds_count"})
        queries = dashboard_queries({"model_name": model, "__rate_interval": "15s", "datasource": "prometheus"})
        assert len(queries) > 30
        missing = queries
        while missing := [(title, expr) for title, expr in missing if not prom.finite_values(expr)]:
            assert time.monotonic() < deadline, f"no data for {len(missing)} panel queries: {missing}"
            time.sleep(1)
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert len(rules) == 8 and all(r["health"] == "ok" for r in rules), rules
    finally:
        stop.set()
        for t in senders:
            t.join(timeout=60)
        prom.stop()

"""The Dockerfiles and the KubeRay manifests agree with `pdserve serve`: the command parses with
its own parser, the config file validates with its own loader, and the ports, the image, the
Ray version and the grace periods line up. Nothing here needs Docker or a Kubernetes cluster."""
from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml

from deploy_files import DEPLOY
from pdserve.cluster.cli import build_parser
from pdserve.cluster.config import DEMO_DRAFT, DEMO_MODEL, REPO, load

KUBERAY = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "pdserve.yaml").read_text())}
MONITORING = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "monitoring.yaml").read_text())}
IMAGE = "pdserve:cuda"


def _instruction(dockerfile: str, name: str) -> str:
    (line,) = [line for line in dockerfile.splitlines() if line.startswith(name + " ")]
    return line[len(name) + 1:]


def _serve_config(tmp_path):
    """The ConfigMap's config, loaded by `pdserve serve`'s loader (the image's model paths
    pointed at this checkout's demo models)."""
    raw = yaml.safe_load(KUBERAY["ConfigMap"]["data"]["pdserve.yaml"])
    assert raw["model"] == "/opt/pdserve/models/demo" and raw["draft_model"] == "/opt/pdserve/models/demo-draft"
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump({**raw, "model": str(DEMO_MODEL), "draft_model": str(DEMO_DRAFT)}))
    return load(str(path), {})


def _head():
    return KUBERAY["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]


def _workers():
    (group,) = KUBERAY["RayCluster"]["spec"]["workerGroupSpecs"]
    return group


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_run_pdserve_serve_on_every_interface(name):
    text = (DEPLOY / name).read_text()
    assert json.loads(_instruction(text, "ENTRYPOINT")) == ["pdserve", "serve"]
    args = build_parser().parse_args(["serve", *json.loads(_instruction(text, "CMD"))])
    assert args.func.__name__ == "_serve_system" and args.host == "0.0.0.0"
    defaults = load(None, {}).router
    assert {int(p) for p in _instruction(text, "EXPOSE").split()} == {defaults.grpc_port, defaults.http_port}
    torch = re.search(r'"torch==([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f'"torch=={torch}"' in text
    assert re.search(r'pip install -e "?\.', text)  # editable: the defaults find /opt/pdserve/models
    assert f"docker build -f deploy/{name} -t pdserve:{'cuda' if 'cuda' in name else 'cpu'} ." in \
        (REPO / "README.md").read_text()


def test_the_rayjob_runs_pdserve_serve_on_the_raycluster_with_the_mounted_config():
    job = KUBERAY["RayJob"]["spec"]
    argv = shlex.split(job["entrypoint"])
    assert argv[0] == "pdserve"
    args = build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "_serve_system" and args.ray_address == "auto"
    (mount,) = _head()["containers"][0]["volumeMounts"]
    (volume,) = _head()["volumes"]
    assert mount["name"] == volume["name"] and volume["configMap"]["name"] == KUBERAY["ConfigMap"]["metadata"]["name"]
    assert args.config == f"{mount['mountPath']}/pdserve.yaml"
    assert job["clusterSelector"] == {"ray.io/cluster": KUBERAY["RayCluster"]["metadata"]["name"]}
    assert "shutdownAfterJobFinishes" not in job or job["shutdownAfterJobFinishes"] is False


def test_the_config_binds_the_pod_and_the_service_exposes_only_the_public_ports(tmp_path):
    config = _serve_config(tmp_path)
    r = config.router
    assert r.host == "0.0.0.0"
    head = _head()["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert (ports["grpc"], ports["http"]) == (r.grpc_port, r.http_port)
    service = KUBERAY["Service"]["spec"]
    assert service["selector"] == {"ray.io/cluster": "pdserve", "ray.io/node-type": "head"}
    assert {(p["port"], p["targetPort"]) for p in service["ports"]} == {(r.grpc_port, "grpc"), (r.http_port, "http")}


def test_images_ray_version_and_gpu_pools_agree(tmp_path):
    config = _serve_config(tmp_path)
    head, group = _head()["containers"][0], _workers()
    (worker,) = group["template"]["spec"]["containers"]
    assert head["image"] == worker["image"] == IMAGE
    ray_pin = re.search(r'"ray>=([\d.]+),<', (REPO / "pyproject.toml").read_text()).group(1)
    assert KUBERAY["RayCluster"]["spec"]["rayVersion"] == ray_pin
    assert f'"ray[default]>={ray_pin},' in (DEPLOY / "Dockerfile.cuda").read_text()
    # one pdserve worker per GPU pod, and enough pods for both pools
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1" == str(int(config.prefill.gpus)) == \
        str(int(config.decode.gpus))
    assert group["replicas"] >= config.prefill.workers + config.decode.workers
    assert float(worker["resources"]["requests"]["cpu"]) >= max(config.prefill.cpus, config.decode.cpus)
    assert KUBERAY["RayCluster"]["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_termination_grace_outlasts_the_drain_and_prestop_signals_pdserve_serve(tmp_path):
    config = _serve_config(tmp_path)
    # the routers' drain (the other router processes' beside the first), then the workers' (serve.py)
    stop_s = config.router.drain_timeout + 15
    serve = (REPO / "cluster" / "serve.py").read_text()
    assert '_quietly(controller.stop.remote(), r.drain_timeout + 15, "workers")' in serve
    assert '_quietly(controller.stop_routers.remote(), r.drain_timeout + 15, "routers")' in serve
    for spec in (_head(), _workers()["template"]["spec"]):
        assert spec["terminationGracePeriodSeconds"] > stop_s
    head = _head()["containers"][0]
    runtime = {e["name"]: e["value"] for e in head["env"]}["PDSERVE_RUNTIME_DIR"]
    script = head["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert f'{runtime}/serve.json' in script and "kill -TERM" in script and "kill -0" in script
    assert config.metrics_targets_file.startswith(runtime)


def test_monitoring_scrapes_the_router_and_finds_the_workers_through_it(tmp_path):
    config = _serve_config(tmp_path)
    pod_monitor, scrape = MONITORING["PodMonitor"]["spec"], MONITORING["ScrapeConfig"]["spec"]
    (endpoint,) = pod_monitor["podMetricsEndpoints"]
    head_ports = {p["name"]: p["containerPort"] for p in _head()["containers"][0]["ports"]}
    assert head_ports[endpoint["port"]] == config.router.http_port and endpoint["path"] == "/metrics"
    assert pod_monitor["selector"]["matchLabels"] == KUBERAY["Service"]["spec"]["selector"]
    (sd,) = scrape["httpSDConfigs"]
    svc = KUBERAY["Service"]["metadata"]
    assert sd["url"] == f"http://{svc['name']}.{svc['namespace']}.svc:{config.router.http_port}/prometheus/targets"
    (drop,) = scrape["relabelings"]  # the router is the PodMonitor's: scraped once
    assert drop["sourceLabels"] == ["pdserve_role"] and drop["regex"] == "router" and drop["action"].lower() == "drop"
    assert endpoint["honorLabels"] and scrape["honorLabels"]

"""deploy/prometheus.yml and deploy/prometheus/alerts.yml through promtool (Debian's
`prometheus` package), and what they must agree with: the ports pdserve listens on by default
and in README's standalone example, and the metric names README documents. The live test, a
real Prometheus scraping `pdserve serve` with these alerts loaded, is in tests/cluster/test_serve.py."""
from __future__ import annotations

import re

import yaml

from deploy_files import DEPLOY, documented_metrics, referenced_metrics
from pdserve.cluster.config import REPO, ServeConfig
from prometheus_server import promtool


def test_promtool_checks_the_scrape_config_and_its_rule_file():
    out = promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    assert out.returncode == 0 and "1 rule files found" in out.stdout, out.stdout + out.stderr


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    out = promtool("check", "rules", str(DEPLOY / "prometheus" / "alerts.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    out = promtool("test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml"))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_a_unit_test_and_reads_documented_metrics():
    rules = [r for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]
    firing = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t.get("exp_alerts")}
    assert firing == {r["alert"] for r in rules}
    for rule in rules:
        names = referenced_metrics(rule["expr"])
        assert names <= documented_metrics(), (rule["alert"], names - documented_metrics())
        assert names or re.search(r'\bup\{pdserve_role="router"\}', rule["expr"]), rule["alert"]


def test_scrape_config_ports_agree_with_the_defaults_and_the_readme():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    # pdserve serve: its default targets file, in Ray's session folder
    (sd,) = jobs["pdserve"]["file_sd_configs"]
    assert sd["files"] == ["/tmp/ray/session_latest/pdserve_targets.json"]
    assert 'Path(config.metrics_targets_file or _session_dir() / "pdserve_targets.json")' in \
        (REPO / "cluster" / "serve.py").read_text()
    # the standalone example: the router's /metrics on its HTTP port, the workers' on --metrics-port
    ports = {g["labels"]["pdserve_role"]: int(t.rsplit(":", 1)[1])
             for g in jobs["pdserve-standalone"]["static_configs"] for t in g["targets"]}
    assert ports["router"] == ServeConfig().router.http_port == 8000
    readme = (REPO / "README.md").read_text()
    standalone = readme[readme.index("## The standalone processes"):]
    standalone = standalone[:standalone.index("```", standalone.index("```") + 3)]  # its example
    commands = {m.group(1): m.group(0) for m in re.finditer(r"pdserve (decode-worker|prefill-worker|router) .*", standalone)}
    assert f"--http-port {ports['router']}" in commands["router"]
    assert f"--port {ServeConfig().router.grpc_port}" in commands["router"]
    assert f"--metrics-port {ports['decode']}" in commands["decode-worker"]
    assert f"--metrics-port {ports['prefill']}" in commands["prefill-worker"]
    for job in jobs.values():
        assert job["honor_labels"] is True  # the series' own model_name and worker labels win

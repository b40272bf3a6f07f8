"""deploy/grafana/pdserve.json as Grafana imports it: panels with PromQL targets, the template
variables they use, and only metrics pdserve exports. Whether every query parses and returns
data is checked against a real Prometheus scraping `pdserve serve` (tests/cluster/test_serve.py)."""
from __future__ import annotations

import json
import re

from deploy_files import DEPLOY, documented_metrics, referenced_metrics

DASHBOARD = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def test_an_importable_dashboard_with_a_model_variable():
    assert DASHBOARD["uid"] and DASHBOARD["title"] and DASHBOARD["schemaVersion"] >= 36
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query" and "model_name" in variables["model_name"]["definition"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for p in PANELS:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and set(p["gridPos"]) == {"h", "w", "x", "y"}, p["title"]


def test_every_query_reads_documented_metrics_of_the_chosen_model():
    used = set()
    for p in PANELS:
        for t in p["targets"]:
            names = referenced_metrics(t["expr"])
            assert names, (p["title"], t["expr"])
            used |= names
            # pdserve series by model; process metrics (no model label) by the targets' pdserve_role
            for selector in re.findall(r"\{([^}]*)\}", t["expr"]):
                assert 'model_name="$model_name"' in selector or 'pdserve_role!=""' in selector, (p["title"], selector)
            assert set(re.findall(r"\$\{?(\w+)", t["expr"])) <= {"model_name", "__rate_interval"}, t["expr"]
    assert used <= documented_metrics(), used - documented_metrics()


def test_the_panels_an_sre_needs_are_there():
    exprs = " ".join(t["expr"] for p in PANELS for t in p["targets"])
    for needed in ("histogram_quantile(0.99, sum by (le) (rate(pdserve:time_to_first_token_seconds_bucket",
                   "pdserve:time_to_first_token_stage_seconds", "pdserve:request_slo_met_total",
                   "pdserve:slo_ttft_seconds", "pdserve:requests_total", "pdserve:kv_cache_usage_perc",
                   "pdserve:num_requests_waiting", "pdserve:kv_transfer_bandwidth_bytes_per_second_bucket",
                   "pdserve:kv_transfer_failures_total", "pdserve:spec_decode_num_accepted_tokens_total",
                   "pdserve:router_num_requests_queued"):
        assert needed in exprs, needed

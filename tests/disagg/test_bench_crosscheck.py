"""`pdserve bench` against router R of the shared cluster, checked against what R itself
measured: the deltas of R's Prometheus TTFT and e2e histograms over the run (sum / count)
against the client-side means. The client measures from before its request leaves to after
each delta arrives, so it may read a little more than the router: the tolerance is 20% or
10 ms, whichever is larger. Uses only R's addresses and `cluster.metrics("R")`."""
from __future__ import annotations

import pytest

from pdserve.loadgen.bench import BenchConfig, run_bench
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.stats import SLO
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind

HISTOGRAMS = {"ttft": "pdserve:time_to_first_token_seconds", "e2e": "pdserve:e2e_request_latency_seconds"}


def _scrape(cluster) -> dict[str, tuple[float, float]]:
    m = cluster.metrics("R")
    return {k: (m[(name + "_sum", frozenset())], m[(name + "_count", frozenset())]) for k, name in HISTOGRAMS.items()}


def _router_means(before, after) -> tuple[dict[str, float], dict[str, float]]:
    counts = {k: after[k][1] - before[k][1] for k in HISTOGRAMS}
    return {k: (after[k][0] - before[k][0]) / counts[k] for k in HISTOGRAMS}, counts


@pytest.mark.parametrize("via", ["grpc", "http"])
def test_client_latencies_agree_with_the_routers_histograms(cluster, via):
    num = 20 if via == "grpc" else 10
    workload = WorkloadConfig(WorkloadKind.RANDOM, LengthDistribution.parse("uniform:8,96"),
                              LengthDistribution.parse("uniform:4,24"), vocab_size=300)
    where = dict(target=cluster.address("R")) if via == "grpc" else dict(http_url=f"http://{cluster.http_address}")
    config = BenchConfig(**where, workload=workload, rates=(8.0,), num_requests=num, seed=4, num_warmup=0,
                         slo=SLO(ttft_s=10.0, tpot_s=10.0), request_timeout_s=60)
    cluster.wait_all_free(("P", "D"))
    before = _scrape(cluster)
    result = run_bench(config, progress=False)
    cluster.wait_all_free(("P", "D"))
    router, counts = _router_means(before, _scrape(cluster))
    (summary,) = result.summaries()
    assert summary.num_ok == num and counts == {"ttft": num, "e2e": num}, (summary.failures, counts)
    assert sum(len(r.delta_tokens) for r in result.runs[0].records) >= num
    client = {"ttft": summary.ttft.mean, "e2e": summary.e2e.mean}
    # the client's clock encloses the router's (its own connection, serialization and event loop
    # come on top: more over HTTP, whose client costs more per request, on a loaded 2-core host)
    slack = 0.010 if via == "grpc" else 0.150
    for k in HISTOGRAMS:
        assert client[k] >= router[k] - 0.002, (k, client, router)
        assert client[k] == pytest.approx(router[k], rel=0.2, abs=slack), (k, client, router)
    assert summary.slo_attainment == 1.0

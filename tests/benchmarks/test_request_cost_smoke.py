"""benchmarks/request_cost.py on its quick setting: one real disaggregated pair serving the fast
engine, short requests over its gRPC and its OpenAI HTTP API, each process's and thread's CPU
read from the processes' /metrics around each run. Every column is filled for every run; no
timing is asserted."""
from __future__ import annotations

import json


def test_both_apis_and_every_process_are_measured(tmp_path, load_benchmark):
    bench = load_benchmark("request_cost")
    bench.main(["--quick", "--engine", "fast", "--out", str(tmp_path)])
    assert not (tmp_path / "request_cost_fast.json").exists()  # a smoke run leaves the measured files alone
    result = json.loads((tmp_path / "request_cost_fast_quick.json").read_text())
    assert (tmp_path / "request_cost_fast_quick.png").stat().st_size > 0
    assert {(r["api"], r["concurrency"]) for r in result["rows"]} == {(a, c) for a in ("grpc", "http") for c in (1, 4)}
    for r in result["rows"]:
        assert set(r["us_per_request"]) == set(bench.COLUMNS), r["us_per_request"].keys()
        # a thread's clock counts nanoseconds; a process's counts ticks (10 ms), which a quick run may not fill
        assert all(v["min"] > 0 for c, v in r["us_per_request"].items() if "process" not in c), r
        assert r["requests_per_s"]["min"] > 0

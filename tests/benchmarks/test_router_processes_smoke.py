"""benchmarks/router_processes.py on its quick setting: one real pair, one router and then two
sharing a port (`--reuse-port`), a closed loop over several gRPC connections each time, every
router's CPU and tokens read from its /metrics. Both front ends serve every request, and the two
routers split the tokens between them; no timing is asserted."""
from __future__ import annotations

import json


def test_one_router_and_two_sharing_a_port_are_measured(tmp_path, load_benchmark):
    bench = load_benchmark("router_processes")
    bench.main(["--quick", "--out", str(tmp_path)])
    assert not (tmp_path / "router_processes_fast.json").exists()  # a smoke run leaves the measured files alone
    result = json.loads((tmp_path / "router_processes_fast_quick.json").read_text())
    assert (tmp_path / "router_processes_fast_quick.png").stat().st_size > 0
    rows = {r["front"]: r for r in result["rows"]}
    assert set(rows) == {bench.ONE, bench.TWO} and result["connections"] == 16
    for r in rows.values():
        assert r["tokens_per_s"]["min"] > 0 and r["router_us_per_token"]["min"] >= 0
    assert rows[bench.ONE]["busiest_share"]["max"] == 1.0  # one router sent every token
    # the run's 16 requests take the 16 connections, spread over both: odds of all on one, 2 in 2^16
    assert rows[bench.TWO]["busiest_share"]["max"] < 1.0

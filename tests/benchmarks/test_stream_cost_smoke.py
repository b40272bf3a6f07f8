"""benchmarks/stream_cost.py on its quick setting: four real disaggregated pairs (a decode worker
and router as started by default, a decode worker with --stream-interval 4, one with
--no-merge-backlog, a router with --no-token-streams; the first measured again with its load on
the OpenAI HTTP API) over one prefill worker, serving the
script's fast engine (a random two-layer model it builds), closed-loop load, each thread's CPU
read from the processes' /metrics around it. Every column is filled for every run; no timing is
asserted."""
from __future__ import annotations

import json


def test_both_pairs_and_every_thread_are_measured(tmp_path, load_benchmark):
    bench = load_benchmark("stream_cost")
    bench.main(["--quick", "--engine", "fast", "--out", str(tmp_path)])
    assert not (tmp_path / "stream_cost_fast.json").exists()  # a smoke run leaves the measured files alone
    result = json.loads((tmp_path / "stream_cost_fast_quick.json").read_text())
    assert (tmp_path / "stream_cost_fast_quick.png").stat().st_size > 0 and result["engine"] == "fast"
    assert {(r["variant"], r["concurrency"]) for r in result["rows"]} == {
        (v, c) for v in ("1", "4", "1, unmerged", "1, own calls", "1, HTTP") for c in (1, 4)}
    for r in result["rows"]:
        assert set(r["us_per_token"]) == set(bench.COLUMNS), r["us_per_token"].keys()
        # a thread's clock counts nanoseconds; a process's counts ticks (10 ms), and a quick run's
        # prefill worker may spend under one
        assert all(v["min"] > 0 for c, v in r["us_per_token"].items() if "process" not in c), r
        assert all(v["min"] >= 0 for v in r["us_per_token"].values()), r
        assert r["tokens_per_s"]["min"] > 0
        assert r["tokens_per_message"]["min"] >= 1
        if r["variant"] == "1":
            assert r["speedup"]["values"] == [1.0]
        if r["variant"] == "4":  # the first token alone, the rest four or more at a time
            assert r["tokens_per_message"]["min"] > 2


def test_a_stream_interval_of_one_for_the_second_pair_is_refused(load_benchmark, capsys):
    import pytest

    bench = load_benchmark("stream_cost")
    with pytest.raises(SystemExit):
        bench.main(["--stream-interval", "1"])
    assert "--stream-interval" in capsys.readouterr().err

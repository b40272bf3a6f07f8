"""benchmarks/process_spread.py on tiny sizes: real engine processes of one configuration,
answering the same batch in turn."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("process_spread")


def test_each_process_answers_every_round_and_the_spread_compares_their_medians(bench):
    result = bench.measure(processes=2, rounds=3, batch_sizes=[1, 2], max_tokens=8,
                           tuned={"graph_capture": "off"}, progress=False)
    assert [r["batch_size"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert len(r["seconds"]) == 2 and all(len(s["values"]) == 3 for s in r["seconds"])
        medians = [s["median"] for s in r["seconds"]]
        assert r["spread"] == pytest.approx(max(medians) / min(medians)) and r["spread"] >= 1.0
        assert {r["fastest"], r["slowest"]} <= {0, 1}
    result["machine"] = dict(cpu_count=2, cpu="", load_avg_1m_start=0.5, load_avg_1m_end=0.6)
    text = bench.markdown(result, "python benchmarks/process_spread.py --processes 2")
    assert text.count("\n| 1 |") == 1 and text.count("\n| 2 |") == 1 and "1: " in text and "2: " in text

"""The bench's outputs: JSON that reads back into summaries (what `--compare` loads), the
Markdown table, and a PNG with one line per configuration."""
from __future__ import annotations

import json

from pdserve.loadgen.bench import BenchConfig, BenchResult, RateRun, format_table
from pdserve.loadgen.goodput import from_sweep
from pdserve.loadgen.plot import plot_sweeps
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.stats import SLO, RunSummary, summarize


def run_at(rate: float, slowdown: float) -> RateRun:
    records = []
    for i in range(10):
        rec = RequestRecord(i, i / rate, 4, 10, sent_s=i / rate)
        for j in range(4):
            rec.add_delta(rec.sent_s + slowdown * (0.05 + 0.01 * j), 1)
        rec.end_s = rec.delta_times_s[-1]
        records.append(rec)
    return RateRun(summarize(records, rate, SLO(0.1, 0.02)), records)


def test_json_table_and_plot(tmp_path):
    config = BenchConfig(target="127.0.0.1:1", rates=(1.0, 2.0), slo=SLO(0.1, 0.02), label="a")
    result = BenchResult(config, [run_at(1.0, 1.0), run_at(2.0, 3.0)])
    result.goodput.update(zip(("swept", "interpolated"), from_sweep([(1.0, 1.0), (2.0, 0.0)])))
    (path, png) = result.write(tmp_path / "a.json")
    obj = json.loads(path.read_text())
    assert obj["config"]["rates"] == [1.0, 2.0] and obj["goodput"]["swept"]["rate"] == 1.0
    assert len(obj["runs"][0]["requests"]) == 10 and obj["runs"][0]["requests"][0]["ttft_s"] > 0
    back = [RunSummary.from_json(r["summary"]) for r in obj["runs"]]
    assert back == result.summaries()
    table = format_table(back)
    assert table.count("\n") == 3 and "| 1 | 10/10 |" in table and "100%" in table and "0%" in table
    other = plot_sweeps({"a": back, "b": [run_at(1.0, 2.0).summary]}, tmp_path / "both.png", SLO(0.1, 0.02))
    assert png.stat().st_size > 1000 and other.stat().st_size > 1000

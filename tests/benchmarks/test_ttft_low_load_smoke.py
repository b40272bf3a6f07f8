"""benchmarks/ttft_low_load.py --draft on the demo pair, a few requests: real prefill, decode and
colocated workers pinned one core each (so the prefill worker takes its one-core path: the first
tokens out, then the draft's pass over the prompt, then the K/V), every worker with the demo
draft. No timing is asserted."""
from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the script's own imports (launcher, report)


def test_a_speculating_pair_and_a_colocated_worker_answer_every_request(load_benchmark, tmp_path):
    bench = load_benchmark("ttft_low_load")
    from launcher import Launcher, scrape

    with Launcher(tmp_path / "logs") as run:
        routers = bench.start(run, [], ["--draft-model", bench.DRAFT])
        # answers long enough to outlast the draft's K/V (the decode worker decodes plainly until
        # they land) on a loaded machine, so it speculates
        rep = bench.one_repeat({arm: r.address for arm, r in routers.items()}, 0, num_requests=4, block=2,
                               output_len="fixed:32")
        stages = {arm: bench.stage_means(r.metrics_address) for arm, r in routers.items()}
        decode = next(p for p in run.procs if p.name == "disagg-D")
        drafted = scrape(decode.metrics_address).get("pdserve:spec_decode_num_draft_tokens_total", 0.0)
    for arm in ("disagg", "colocated"):
        assert len(rep[arm]["ttft_s"]) == 4 and all(t > 0 for t in rep[arm]["ttft_s"])
        assert rep[arm]["ttft_p50_s"] <= rep[arm]["ttft_p90_s"]
    assert stages["disagg"]["prefill"] > 0 and stages["colocated"]["transfer"] == 0
    assert drafted > 0  # the decode worker speculated on the draft K/V the prefill worker sent

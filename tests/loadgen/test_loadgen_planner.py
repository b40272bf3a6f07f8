"""Cost profiles on disk, and the planner on cases whose answer is plain: prefill-bound traffic
wants more prefill than decode workers, decode-bound traffic the reverse, and an SLO nothing can
meet has no goodput."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.loadgen.costs import CostProfile, SpeculationCost, StepCost, TransferCost, WorkerLimits
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.planner import PlanConfig, plan
from pdserve.loadgen.simulator import Traffic
from pdserve.loadgen.stats import SLO

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def make_profile(prefill_per_token: float, decode_fixed: float) -> CostProfile:
    return CostProfile("test", "none", StepCost(0.002, per_token_s=prefill_per_token),
                       StepCost(decode_fixed, per_seq_s=1e-4), TransferCost(1000, 1e9),
                       WorkerLimits(max_num_seqs=32, max_num_batched_tokens=512),
                       SpeculationCost(3, 0.6, 0.2, step=StepCost(2 * decode_fixed)), notes={"prefill": "made up"})


def test_profile_round_trips_and_refuses_bad_numbers(tmp_path):
    p = make_profile(1e-4, 0.01)
    assert CostProfile.load(p.save(tmp_path / "p.json")) == p
    obj = p.to_json()
    obj["decode"]["fixed_s"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="fixed_s"):
        CostProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="acceptance_rate"):
        SpeculationCost(2, 1.0, 0.1)


TRAFFIC = Traffic(LengthDistribution.parse("fixed:256"), LengthDistribution.parse("fixed:16"))
CONFIG = PlanConfig(SLO(ttft_s=1.0, tpot_s=0.2), max_workers=3, num_requests=120, search_steps=3,
                    include_colocated=False)


def test_prefill_bound_traffic_wants_more_prefill_workers():
    result = plan(make_profile(prefill_per_token=4e-4, decode_fixed=0.002), TRAFFIC, CONFIG)
    best = result.best(colocated=False)
    assert best.shape.num_prefill > best.shape.num_decode
    by_label = {r.shape.label: r.rate for r in result.rows}
    assert by_label["2P:1D"] > 1.5 * by_label["1P:2D"]


def test_decode_bound_traffic_wants_more_decode_workers():
    config = PlanConfig(SLO(ttft_s=1.0, tpot_s=0.03), max_workers=3, num_requests=120, search_steps=3,
                        include_colocated=False)
    result = plan(make_profile(prefill_per_token=1e-6, decode_fixed=0.02), TRAFFIC, config, target_rate=1e6)
    best = result.best(colocated=False)
    assert best.shape.num_decode > best.shape.num_prefill
    assert "no shape up to 3 workers reaches it" in result.answer()[-1]


def test_an_slo_nothing_meets_has_no_goodput():
    config = PlanConfig(SLO(ttft_s=0.001), max_workers=2, num_requests=20, speculation=(False, True))
    result = plan(make_profile(1e-4, 0.01), TRAFFIC, config)
    assert all(r.goodput.rate is None for r in result.rows) and len(result.rows) == 6  # 1P:1D, 1 and 2 colocated
    assert result.answer() == ["no shape meets the SLOs at any rate"]
    assert "even without load" in result.rows[0].goodput.describe()


def test_plan_command_answers_and_refuses_bad_input(tmp_path):
    path = make_profile(4e-4, 0.002).save(tmp_path / "p.json")
    out = subprocess.run([PDSERVE, "plan", "--profile", str(path), "--prompt-len", "fixed:256", "--output-len",
                          "fixed:16", "--slo-ttft", "1", "--slo-tpot", "0.2", "--max-workers", "2", "--num-requests",
                          "60", "--search-steps", "2", "--quiet", "--output", str(tmp_path / "plan.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "best disaggregated: 1P:1D" in out.stdout and "| 2 colocated |" in out.stdout
    assert "colocated shapes: priced with the profile's disaggregated steps" in out.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["rows"]
    for args, message in ((["--profile", str(tmp_path / "none.json"), "--slo-ttft", "1"], "cannot read profile"),
                          (["--profile", str(path)], "needs an SLO"),
                          (["--profile", str(path), "--slo-ttft", "1", "--output-len", "pareto:1"], "--output-len")):
        bad = subprocess.run([PDSERVE, "plan", "--quiet", *args], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_bench_inputs_are_the_traffic_bench_sends():
    from pdserve.loadgen.bench import BenchConfig
    from pdserve.loadgen.simulator import bench_inputs
    from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind, build_workload

    workload = WorkloadConfig(WorkloadKind.RANDOM, LengthDistribution.parse("uniform:5,50"),
                              LengthDistribution.parse("uniform:2,9"))
    cfg = BenchConfig(target="127.0.0.1:1", workload=workload, rates=(3.0,), num_requests=25, seed=7)
    inputs = bench_inputs(cfg, 3.0)
    specs = build_workload(workload, 25, 7)
    assert [x.arrival_s for x in inputs] == cfg.process(3.0).times(25, 7)
    assert [(x.prompt_len, x.output_len) for x in inputs] == [(len(s.prompt), s.max_tokens) for s in specs]
    text = BenchConfig(target="127.0.0.1:1", rates=(3.0,), num_requests=5)  # code cuts without a tokenizer
    with pytest.raises(ValueError, match="known length"):
        bench_inputs(text, 3.0)

"""`pdserve calibrate` against router R of the shared cluster (prefill P, decode D speculating at
k = 3): a profile that counts the engine as almost free gets the deployment's overheads from
real requests, after which the simulator predicts what was measured; and the command's bad
input is one line and exit 2."""
from __future__ import annotations

import dataclasses
import functools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.loadgen.bench import BenchConfig
from pdserve.loadgen.calibrate import calibrate, point
from pdserve.loadgen.costs import CostProfile, SpeculationCost, StepCost, TransferCost, WorkerLimits
from pdserve.loadgen.lengths import LengthDistribution
from pdserve.loadgen.simulator import Shape, bench_inputs
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind

from procs import MAX_NUM_SEQS, NUM_KV_BLOCKS

PDSERVE = str(Path(sys.executable).with_name("pdserve"))
SHAPE = Shape(1, 1, speculate=True)  # R's: P, and D drafting with the model itself, k = 3
# the engine counted as nearly free: what the deployment measures is then almost all overhead.
# (At a tenth of a millisecond a step, 2e-4 with speculation, a step of four accepted tokens was
# priced at what the tiny model's steps measure, and a quick unloaded point could measure them
# under that: no step overhead at all.)
ENGINE = CostProfile("tiny", "test", prefill=StepCost(1e-5, per_token_s=1e-8), decode=StepCost(1e-5),
                     transfer=TransferCost(1000, 1e10), limits=WorkerLimits(MAX_NUM_SEQS, 256, NUM_KV_BLOCKS * 16),
                     speculation=SpeculationCost(3, 0.9, 0.1, step=StepCost(2e-5)))
# Outputs long enough that R's requests speculate on a loaded machine: D decodes plainly until the
# draft's K/V land (`KVTargetReady`), 2-3 ms after the target's here, 1-2 of the tiny model's
# steps; in a loaded CI run every request of 8-24 tokens ended before they did, and calibrating
# with --speculation was refused ("it does not speculate").
OUTPUT_LEN = "uniform:40,56"
WORKLOAD = WorkloadConfig(WorkloadKind.RANDOM, LengthDistribution.parse("uniform:8,64"),
                          LengthDistribution.parse(OUTPUT_LEN), vocab_size=300)


def test_the_calibrated_profile_predicts_what_the_deployment_measured(cluster):
    cluster.wait_all_free(("P", "D"))
    config = BenchConfig(target=cluster.address("R"), workload=WORKLOAD, seed=7, num_warmup=1, request_timeout_s=60)
    profile, cal = calibrate(ENGINE, SHAPE, config, num_requests=8, concurrency=4, loaded_requests=12)
    assert cal.request_overhead_s + cal.prefill_overhead_s > 0 and cal.step_overhead_s + cal.per_seq_overhead_s > 0
    assert cal.measured_loaded.steady_tpot_s > 0 and cal.loaded_concurrency == 4
    # D drafts with the target itself at greedy: every draft token is accepted, 4 tokens a step
    assert cal.acceptance_rate > 0.95 and profile.speculation.acceptance_rate == cal.acceptance_rate
    again = point(profile, SHAPE, bench_inputs(dataclasses.replace(config, num_requests=8), 0.01), config.seed)
    measured = cal.measured_unloaded
    # the K/V's hand-over: the gap from the prefill's token to the decode worker's first step
    if cal.step_overhead_s > 0:
        assert again.steady_tpot_s == pytest.approx(measured.steady_tpot_s, rel=0.05)
        if cal.handover_s > 0:
            assert again.first_gap_s == pytest.approx(measured.first_gap_s, rel=0.1)
    else:  # the loaded point asked more of each sequence than an unloaded step's whole excess,
        # and the first gap holds one of those steps
        assert again.steady_tpot_s >= measured.steady_tpot_s
        assert again.first_gap_s >= 0.95 * measured.first_gap_s
    if cal.request_overhead_s > 0:
        assert again.ttft_s == pytest.approx(measured.ttft_s, rel=0.05)
    else:  # the loaded point asked more of each prompt's prefill than the unloaded TTFT's excess
        assert again.ttft_s >= measured.ttft_s
    if cal.per_seq_overhead_s > 0:  # else the simulation was already as slow as the loaded point
        # twelve requests' simulated median jumps where an overhead reorders the events of a
        # loaded run, so within 20% here
        assert cal.calibrated_loaded.steady_tpot_s == pytest.approx(cal.measured_loaded.steady_tpot_s, rel=0.2)
    cluster.wait_all_free(("P", "D"))


def test_the_command_writes_a_calibrated_profile(cluster, tmp_path):
    cluster.wait_all_free(("P", "D"))
    ENGINE.save(tmp_path / "engine.json")
    out = subprocess.run([PDSERVE, "calibrate", "--profile", str(tmp_path / "engine.json"), "--output",
                          str(tmp_path / "calibrated.json"), "--speculation", "--target", cluster.address("R"),
                          "--workload", "random", "--vocab-size", "300", "--prompt-len", "uniform:8,64",
                          "--output-len", OUTPUT_LEN, "--num-requests", "4", "--concurrency", "2", "--loaded-requests", "6", "--connections", "2",
                          "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("1P:1D +spec: unloaded: measured TTFT") and "a sequence; per prompt prefilled" in out.stdout
    assert "per prompt handed over" in out.stdout and "2 in flight: measured" in out.stdout
    profile = CostProfile.load(tmp_path / "calibrated.json")
    assert "pdserve calibrate" in profile.notes["calibration"]
    assert profile.request_overhead_s + profile.prefill.per_seq_s > 0  # the router's and prefill side's time
    assert profile.decode.fixed_s >= ENGINE.decode.fixed_s and profile.decode.per_seq_s >= ENGINE.decode.per_seq_s
    assert profile.prefill.fixed_s == ENGINE.prefill.fixed_s and profile.prefill.per_token_s == ENGINE.prefill.per_token_s
    assert not math.isnan(profile.decode.per_seq_s)
    cluster.wait_all_free(("P", "D"))


@pytest.mark.parametrize("args, message", [
    (["--target", "127.0.0.1:1"], "127.0.0.1:1"),
    (["--target", "127.0.0.1:1", "--prefill-workers", "-1"], "num_prefill"),
    (["--target", "127.0.0.1:1", "--num-requests", "1"], "at least 2 requests"),
    (["--target", "127.0.0.1:1", "--concurrency", "1"], "at least 2"),
    (["--target", "127.0.0.1:1", "--open-fraction", "1.5"], "open_fraction must be in [0, 1)"),
    (["--target", "127.0.0.1:1", "--colocated-only"], "calibrate a plain colocated deployment (--prefill-workers 0"),
    (["--target", "127.0.0.1:1", "--colocated-only", "--prefill-workers", "0", "--speculation"], "without --speculation"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    ENGINE.save(tmp_path / "engine.json")
    out = subprocess.run([PDSERVE, "calibrate", "--profile", str(tmp_path / "engine.json"), "--output",
                          str(tmp_path / "out.json"), "--quiet", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("router, args, message", [
    ("R", [], "the deployment speculates (its decode steps streamed 4.00 tokens each)"),  # every draft accepted
    ("R2", ["--prefill-workers", "0", "--speculation"], "it does not speculate"),
])
def test_a_deployment_calibrated_as_what_it_is_not_is_refused(cluster, tmp_path, router, args, message):
    # R's decode worker drafts with the target itself at greedy (4 tokens a step); R2's does not draft
    cluster.wait_all_free(("P", "D", "D2"))
    ENGINE.save(tmp_path / "engine.json")
    out = subprocess.run([PDSERVE, "calibrate", "--profile", str(tmp_path / "engine.json"), "--output",
                          str(tmp_path / "out.json"), "--target", cluster.address(router), "--workload", "random",
                          "--vocab-size", "300", "--prompt-len", "uniform:8,64", "--output-len", OUTPUT_LEN,
                          "--num-requests", "2", "--concurrency", "0", "--quiet", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "out.json").exists()


def test_speculation_needs_a_profile_that_has_its_costs(tmp_path):
    dataclasses.replace(ENGINE, speculation=None).save(tmp_path / "plain.json")
    out = subprocess.run([PDSERVE, "calibrate", "--profile", str(tmp_path / "plain.json"), "--output",
                          str(tmp_path / "out.json"), "--speculation", "--target", "127.0.0.1:1", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no speculation costs" in out.stderr


def test_speculation_only_adds_the_speculative_steps_to_a_plain_calibration(cluster, tmp_path):
    # R2 (colocated, plain) calibrates the profile; then R, whose decode worker speculates, adds only
    # what its speculative steps cost beyond that
    cluster.wait_all_free(("P", "D", "D2"))
    ENGINE.save(tmp_path / "engine.json")
    calibrate_cmd = functools.partial(_calibrate_cmd, tmp_path)

    refused = calibrate_cmd("engine.json", "x.json", "--speculation-only", "--target", cluster.address("R"))
    assert refused.returncode == 2 and "was not calibrated" in refused.stderr, refused.stderr
    plain = calibrate_cmd("engine.json", "plain.json", "--prefill-workers", "0", "--target", cluster.address("R2"))
    assert plain.returncode == 0, plain.stderr
    assert "open loop at" in plain.stdout  # the prompt's overhead from arrivals at a rate the pair can carry
    spec = calibrate_cmd("plain.json", "spec.json", "--speculation-only", "--target", cluster.address("R"))
    assert spec.returncode == 0, spec.stderr
    assert "overheads of a speculative step beyond the profile's" in spec.stdout
    before, after = CostProfile.load(tmp_path / "plain.json"), CostProfile.load(tmp_path / "spec.json")
    assert (after.decode, after.prefill, after.transfer) == (before.decode, before.prefill, before.transfer)
    assert after.request_overhead_s == before.request_overhead_s
    assert after.speculation.step.fixed_s >= before.speculation.step.fixed_s
    assert after.speculation.step.per_seq_s >= before.speculation.step.per_seq_s
    assert after.speculation.acceptance_rate > 0.95  # D drafts with the target itself at greedy
    assert "pdserve calibrate --speculation-only" in after.notes["speculation_calibration"]
    cluster.wait_all_free(("P", "D", "D2"))


def test_colocated_only_gives_the_colocated_workers_their_own_steps(cluster, tmp_path):
    # R (disaggregated, speculating) calibrates every overhead; then R2, the plain colocated worker,
    # gets steps of its own, which the colocated shapes run on, and the disaggregated ones keep theirs
    cluster.wait_all_free(("P", "D", "D2"))
    ENGINE.save(tmp_path / "engine.json")
    calibrate_cmd = functools.partial(_calibrate_cmd, tmp_path)

    colocated = ["--colocated-only", "--prefill-workers", "0", "--target", cluster.address("R2")]
    refused = calibrate_cmd("engine.json", "x.json", *colocated)
    assert refused.returncode == 2 and "was not calibrated" in refused.stderr, refused.stderr
    pair = calibrate_cmd("engine.json", "pair.json", "--speculation", "--target", cluster.address("R"))
    assert pair.returncode == 0, pair.stderr
    done = calibrate_cmd("pair.json", "both.json", *colocated)
    assert done.returncode == 0, done.stderr
    assert "a colocated worker's own steps" in done.stdout and "open loop at" in done.stdout
    before, after = CostProfile.load(tmp_path / "pair.json"), CostProfile.load(tmp_path / "both.json")
    assert before.colocated is None and after.colocated is not None
    assert (after.decode, after.prefill, after.transfer, after.speculation, after.request_overhead_s) == (
        before.decode, before.prefill, before.transfer, before.speculation, before.request_overhead_s)
    own = after.colocated
    assert own.decode.fixed_s + own.decode.per_seq_s > 0  # the engine counted as free: the serving's
    assert own.decode.per_token_s == ENGINE.decode.per_token_s and own.prefill.per_token_s == ENGINE.prefill.per_token_s
    assert "pdserve calibrate --colocated-only" in after.notes["colocated_calibration"]
    # the colocated shape is priced with them, the disaggregated one as before
    inputs = bench_inputs(BenchConfig(target="unused", workload=WORKLOAD, rates=(20.0,), num_requests=20, seed=3), 20.0)
    assert point(after, Shape(0, 1), inputs, 3) != point(before, Shape(0, 1), inputs, 3)
    assert point(after, SHAPE, inputs, 3) == point(before, SHAPE, inputs, 3)
    plan = subprocess.run([PDSERVE, "plan", "--profile", str(tmp_path / "both.json"), "--max-workers", "2",
                           "--num-requests", "40", "--search-steps", "2", "--slo-ttft", "0.5", "--slo-tpot", "0.05",
                           "--prompt-len", "uniform:8,64", "--output-len", "uniform:8,24", "--quiet"], capture_output=True, text=True,
                          timeout=120)
    assert plan.returncode == 0 and "colocated shapes: their own steps" in plan.stdout, plan.stderr
    cluster.wait_all_free(("P", "D", "D2"))


def _calibrate_cmd(tmp_path: Path, profile: str, output: str, *args: str) -> subprocess.CompletedProcess:
    """`pdserve calibrate` from tmp_path/profile to tmp_path/output, on a few short random requests."""
    common = ["--workload", "random", "--vocab-size", "300", "--prompt-len", "uniform:8,64", "--output-len",
              OUTPUT_LEN, "--num-requests", "4", "--concurrency", "2", "--loaded-requests", "6", "--quiet"]
    return subprocess.run([PDSERVE, "calibrate", "--profile", str(tmp_path / profile), "--output",
                           str(tmp_path / output), *common, *args], capture_output=True, text=True, timeout=120)

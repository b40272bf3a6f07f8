"""benchmarks/spec_decode.py's core on tiny sizes, each method's engine in a process of its own:
every row has its keys, greedy outputs with speculation equal those without, and so do
coupled-verifier outputs at temperature 1 and the control (plain decoding in another process).
No timing is asserted; the benchmark does the measuring."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO, DEMO_DRAFT = ROOT / "models" / "demo", ROOT / "models" / "demo-draft"


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("spec_decode")


@pytest.fixture(scope="module")
def report(load_benchmark):
    return load_benchmark("spec_decode_report")


def test_demo_models_are_committed():
    """The benchmark runs on the committed pair: a checkout without them is broken, not skipped."""
    for path in (DEMO, DEMO_DRAFT):
        assert (path / "model.safetensors").is_file(), f"{path} is missing its weights"


def test_core_runs_and_outputs_match(bench):
    methods = tuple(m for m in bench.METHODS + bench.OPTIONAL + bench.NEWCOMER  # k=1: an engine named only on request
                    if m.name in ("plain", "draft k=1", "draft adaptive", "ngram adaptive", "draft k=4 rejection", "newcomer plain",
                                  "newcomer draft k=4", "plain, another process"))
    result = bench.run_benchmark(str(DEMO), str(DEMO_DRAFT), batch_sizes=[1, 2], temperatures=[0.0, 1.0],
                                 max_tokens=8, runs=2, methods=methods, tuned={"graph_capture": "off"}, progress=False,
                                 rounds=2)
    rows = result["rows"]
    by = {(r["batch_size"], r["temperature"], r["method"]): r for r in rows}
    assert (1, 1.0, "draft k=4 rejection") in by and (1, 0.0, "draft k=4 rejection") not in by  # temperature 1 only
    assert (1, 0.0, "newcomer draft k=4") in by and (2, 0.0, "newcomer draft k=4") not in by  # batch 1 only
    for r in rows:
        assert {"method", "batch_size", "temperature", "tokens_per_s", "num_tokens"} <= r.keys()
        assert r["num_tokens"] == 8 * r["batch_size"]  # ignore_eos: every prompt emits max_tokens
        if r["method"] in ("plain", "newcomer plain"):  # a run before each method's and after it, one A/A pair each
            others = [m for m in methods if m.is_newcomer == r["is_newcomer"] and not m.is_plain
                      and (r["batch_size"], r["temperature"]) in bench.cases_of(m, [1, 2], [0.0, 1.0])]
            assert len(r["tokens_per_s"]["values"]) == 2 * (len(others) + 1)
            assert len(r["a_a"]["values"]) == 2 * len(others)
            assert len(r["a_a_decode"]["values"]) == 2 * len(others)
            continue
        assert len(r["tokens_per_s"]["values"]) == 2
        if r["method"] == "plain, another process":
            assert "decode_speedup" in r
            continue
        assert {"speedup", "own_speedup", "own_decode_speedup", "alpha", "mean_accepted_length", "mean_k", "c"} <= r.keys()
        assert len(r["own_speedup"]["values"]) == 2 and r["own_speedup"]["min"] > 0
        assert 0 <= r["alpha"] <= 1 and r["speedup"]["min"] <= r["speedup"]["median"] <= r["speedup"]["max"]
        assert 0 < r["decode_speedup"]["min"] <= r["decode_speedup"]["max"]
        if "rejection" in r["method"]:
            assert "same_tokens_as_plain" not in r  # the rejection sampler's tokens depend on the draft
        else:
            assert r["same_tokens_as_plain"] is True, r  # greedy, or the coupled verifier
    control = [r for r in rows if r["method"] == "plain, another process"]
    assert len(control) == 4 and all("alpha" not in r and r["same_tokens_as_plain"] for r in control)
    assert result["startup_seconds"].keys() == {m.name for m in methods}
    drafts = [r for r in rows if r["method"] == "draft k=1"]
    assert drafts and all(r["c"] is not None and r["c"] > 0 and 0 < r["mean_k"] <= 1 for r in drafts)
    # an adaptive method's every repeat keeps its drafts and its cost lines before and after the run
    # (the newcomer's README options adapt the depth: the default)
    for r in rows:
        adaptive = r["method"] in ("draft adaptive", "ngram adaptive", "newcomer draft k=4")
        assert ("per_repeat" in r) == adaptive, r["method"]
        for rep in r.get("per_repeat", []):
            assert rep["speedup"] > 0 and rep["num_drafts"] >= 0
            for lines in (rep["cost_lines"]["before"], rep["cost_lines"]["after"]):
                assert lines["target"]["fixed"] >= 0 and lines["target"]["row"] >= 0
                assert (lines["draft"] is None) == (r["method"] == "ngram adaptive")
                assert lines["draft"] is None or (lines["draft"]["a"] >= 0 and isinstance(lines["draft"]["is_guess"], bool))
        if adaptive:
            assert len(r["per_repeat"]) == 2
    assert all("share_of_ideal" in r for r in drafts if r["num_drafts"])
    # every method's first run of each of its cases (its warm-up) is reported apart, against its
    # baseline's first run of the case
    first = {(r["batch_size"], r["temperature"], r["method"]): r for r in result["first_runs"]}
    assert first.keys() == {(b, t, m.name) for m in methods if not m.is_plain
                            for b, t in bench.cases_of(m, [1, 2], [0.0, 1.0])}
    assert all(r["speedup"] > 0 and r["decode_speedup"] > 0 for r in first.values())


def test_markdown_has_a_line_per_row_and_goals(report):
    rows = [dict(method="plain", batch_size=1, temperature=0.0, is_newcomer=False,
                 tokens_per_s=dict(min=90.0, median=100.0, max=110.0, values=[90.0, 100.0, 110.0])),
            dict(method="draft k=4", batch_size=1, temperature=0.0, is_newcomer=False,
                 tokens_per_s=dict(min=190.0, median=200.0, max=210.0, values=[190.0, 200.0, 210.0]),
                 speedup=dict(min=2.4, median=2.6, max=2.7, values=[2.4, 2.6, 2.7]),
                 decode_speedup=dict(min=2.5, median=2.8, max=2.9, values=[2.5, 2.8, 2.9]), alpha=0.8,
                 mean_accepted_length=3.4, mean_k=4.0, c=0.1, ideal_speedup=2.4,
                 share_of_ideal=dict(min=1.0, median=1.08, max=1.1, values=[1.0, 1.08, 1.1]),
                 same_tokens_as_plain=False)]
    newcomer = dict(rows[1], method="newcomer draft k=4", is_newcomer=True, same_tokens_as_plain=True,
                    speedup=dict(min=2.5, median=2.9, max=3.1, values=[2.5, 2.9, 3.1]),
                    share_of_ideal=dict(min=0.8, median=0.9, max=0.95, values=[0.8, 0.9, 0.95]))
    lines = report.markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert "**no**" in lines[-1]  # a mismatch stands out
    verdicts = {g.name: g.is_met for g in report.goals(rows + [newcomer])}
    assert verdicts["batch 1 greedy, draft k=4: speedup"] is False  # the worst repeat, 2.4, decides
    assert verdicts["batch 1 greedy, draft k=4: decode speedup"] is True  # judged beside the whole run's
    assert verdicts["batch 1 greedy, draft k=4: share of ideal"] is True
    # default options are judged beside the tuned ones
    assert verdicts["batch 1 greedy, newcomer draft k=4: speedup"] is True
    assert verdicts["batch 1 greedy, newcomer draft k=4: share of ideal"] is False
    # at batches 8 and 32 the adaptive methods are judged against plain decoding's process and,
    # apart, against their own engine with speculation set aside
    b8 = dict(rows[1], method="draft adaptive", batch_size=8, speedup=dict(min=0.93, median=0.97, max=1.0,
                                                                          values=[0.93, 0.97, 1.0]),
              own_speedup=dict(min=0.99, median=1.02, max=1.04, values=[0.99, 1.02, 1.04]))
    verdicts = {g.name: g.is_met for g in report.goals([b8])}
    assert verdicts == {"batch 8, temp 0, draft adaptive: speedup (median)": False,
                        "batch 8, temp 0, draft adaptive: speedup (every repeat)": False,
                        "batch 8, temp 0, draft adaptive: speedup, vs its own engine (median)": True,
                        "batch 8, temp 0, draft adaptive: speedup, vs its own engine (every repeat)": True}
    assert "| 0.99 / 1.02 / 1.04 |" in report.markdown_table([b8])
    # the rejection sampler's adaptive method too (not the default verifier: its goals stand beside)
    rejection = dict(b8, method="draft adaptive rejection", batch_size=32, temperature=1.0)
    verdicts = {g.name: g.is_met for g in report.goals([rejection])}
    assert verdicts == {"batch 32, temp 1, draft adaptive rejection: speedup (median)": False,
                        "batch 32, temp 1, draft adaptive rejection: speedup (every repeat)": False,
                        "batch 32, temp 1, draft adaptive rejection: speedup, vs its own engine (median)": True,
                        "batch 32, temp 1, draft adaptive rejection: speedup, vs its own engine (every repeat)": True}
    # the adaptive methods' first runs, apart from the table
    first = [dict(batch_size=8, temperature=1.0, method="draft adaptive", speedup=0.91, decode_speedup=0.97),
             dict(batch_size=8, temperature=1.0, method="draft k=2", speedup=0.8, decode_speedup=0.8)]
    text = " ".join(report.first_runs_text(first))
    assert "draft adaptive batch 8 temp 1: 0.91× (0.97× decode)" in text and "k=2" not in text
    assert report.first_runs_text(first[1:]) == []


def test_each_method_runs_between_two_runs_of_its_baseline(bench):
    """B O m1 O B O m2 O B …, the newcomer draft between newcomer plain runs, and each
    speculative method's run between two of its own engine's with speculation set aside (O): a
    speedup divides by its neighbours, and an A/A pair is two baseline runs one method's runs
    apart, never across engines. The control, plain decoding in another process, has no own runs."""
    plain, k4, k2 = bench.METHODS[:3]
    control = next(m for m in bench.METHODS if m.is_control)
    new_plain, new_k4 = bench.NEWCOMER
    clock = iter(range(1, 100))
    calls = []

    def run(m, own_plain=False):
        calls.append(("own " if own_plain else "") + m.name)
        return dict(seconds=float(next(clock)), token_ids=[m.name, own_plain])

    runs = list(bench._paired([new_k4, k2, plain, control, k4, new_plain], run))
    assert calls == ["newcomer plain", "own newcomer draft k=4", "newcomer draft k=4", "own newcomer draft k=4",
                     "newcomer plain", "plain", "own draft k=2", "draft k=2", "own draft k=2", "plain",
                     "plain, another process", "plain", "own draft k=4", "draft k=4", "own draft k=4", "plain"]
    assert [m.name for m, _ in runs] == ["newcomer plain", "newcomer draft k=4", "newcomer plain", "plain", "draft k=2",
                                         "plain", "plain, another process", "plain", "draft k=4", "plain"]
    by_name = {m.name: r for m, r in runs}
    assert by_name["newcomer draft k=4"]["baseline_seconds"] == (1 + 5) / 2
    assert by_name["newcomer draft k=4"]["own_plain_seconds"] == (2 + 4) / 2
    assert by_name["newcomer draft k=4"]["baseline_token_ids"] == ["newcomer plain", False]
    assert by_name["newcomer draft k=4"]["own_plain_token_ids"] == ["newcomer draft k=4", True]
    assert by_name["draft k=2"]["baseline_seconds"] == (6 + 10) / 2 and by_name["draft k=2"]["own_plain_seconds"] == (7 + 9) / 2
    assert by_name["plain, another process"]["baseline_seconds"] == (10 + 12) / 2
    assert "own_plain_seconds" not in by_name["plain, another process"]
    assert by_name["draft k=4"]["baseline_seconds"] == (12 + 16) / 2
    pairs = [(r["previous_baseline_seconds"], r["seconds"]) for _, r in runs if "previous_baseline_seconds" in r]
    assert pairs == [(1.0, 5.0), (6.0, 10.0), (10.0, 12.0), (12.0, 16.0)]  # none from newcomer plain (5) to plain (6)


def test_an_engine_process_that_dies_is_named_not_waited_on(bench):
    """An engine process that ends (here: killed) fails the run with the method's name at once,
    instead of the benchmark waiting on its pipe."""
    plain = bench.METHODS[0]
    setup = bench.Setup(str(DEMO), str(DEMO_DRAFT), 32, 2, {"graph_capture": "off"}, 1, 1)
    engine = bench.start_engine(plain, setup)
    try:
        assert engine.hello > 0
        first = engine.ask(dict(prompts=[[1, 2, 3]], params=dict(temperature=0, max_tokens=4, ignore_eos=True)))
        assert len(first["token_ids"][0]) == 4
        engine.proc.kill()
        engine.proc.wait()
        with pytest.raises(RuntimeError, match="'plain' engine process ended"):
            engine.ask(dict(prompts=[[1, 2, 3]], params=dict(temperature=0, max_tokens=4, ignore_eos=True)), timeout_s=60)
    finally:
        engine.close()


def test_the_decode_phase_starts_when_every_prompt_has_its_first_token(bench):
    """`generate_timed` gives the same tokens as `LLM.generate`, and counts in the decode phase
    every token after each request's first (here every prompt is prefilled in the first step)."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(DEMO), graph_capture="off")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs, decode_start, decode_tokens = bench.generate_timed(llm, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]
    assert decode_tokens == 2 * (6 - 1)
    run = bench.run_once(llm, prompts, params)
    assert run["decode_tokens"] == 10 and 0 < run["decode_seconds"] < run["seconds"]


def test_the_draft_timer_sees_the_passes_inside_fused_steps(bench):
    """c's draft figure: a greedy speculative step fuses the draft's passes with the verification
    (`fused_step`), and `FusedTimer` hands them to the draft's `ForwardTimer`, one entry a pass at
    the op's own seconds; without it the figure came only from the few steps that did not fuse."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(DEMO), draft_model=str(DEMO_DRAFT), num_speculative_tokens=3, spec_adaptive=False,
              num_kv_blocks=64)
    fused = llm.engine.fused_step
    assert fused is not None
    timer, calls = bench.ForwardTimer(llm.engine.draft_runner), []

    class Counted:
        def __getattr__(self, name):  # covers, prepare, takes: the fused step's own
            return getattr(fused, name)

        def __call__(self, batch):
            calls.append(len(batch))
            return fused(batch)
    llm.engine.fused_step = bench.FusedTimer(Counted(), timer)
    llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert calls and all(n == 1 for n in calls)
    fused_passes = [s for n, s in timer.calls if n == 1]
    assert len(fused_passes) >= 3 * len(calls) and all(s > 0 for s in fused_passes)
    assert timer.median_at(1) is not None


def test_a_repeat_keeps_each_runs_median_round(bench):
    """--rounds: of a run's records in a repeat's rounds, the one whose ratio is the median, whole
    (its seconds, counters and tokens together): a method's by its speedup over the plain runs
    beside it, plain decoding's by its A/A pair, or by its seconds where it has none."""
    plain, k4 = bench.METHODS[0], bench.METHODS[1]
    rounds = [dict(seconds=s, baseline_seconds=2.0, num_drafts=i) for i, s in enumerate((1.0, 4.0, 2.0))]
    assert bench.median_round(rounds, k4)["num_drafts"] == 2  # speedups 2, 0.5, 1: the median 1
    assert bench.median_round(rounds[:2], k4)["num_drafts"] == 1  # two: the lower, 0.5
    pairs = [dict(seconds=2.0, previous_baseline_seconds=p, tag=p) for p in (1.0, 3.0, 2.2)]
    assert bench.median_round(pairs, plain)["tag"] == 2.2
    alone = [dict(seconds=s, tag=s) for s in (1.0, 5.0, 3.0)]
    assert bench.median_round(alone, plain)["tag"] == 3.0

"""benchmarks/spec_decode.py's core on tiny sizes: every row has its keys, and greedy outputs with
speculation equal those without. No timing is asserted; the benchmark does the measuring."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO, DEMO_DRAFT = ROOT / "models" / "demo", ROOT / "models" / "demo-draft"


@pytest.fixture(scope="module")
def bench():
    # by path: benchmarks/ also holds a `kernels.py` that must not shadow the kernels package
    spec = importlib.util.spec_from_file_location("spec_decode_bench", ROOT / "benchmarks" / "spec_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (DEMO / "model.safetensors").is_file() or not (DEMO_DRAFT / "model.safetensors").is_file(),
                    reason="the demo models are not in this checkout")
def test_core_runs_and_greedy_outputs_match(bench):
    methods = tuple(m for m in bench.METHODS if m.name in ("plain", "draft k=2", "ngram adaptive"))
    result = bench.run_benchmark(str(DEMO), str(DEMO_DRAFT), batch_sizes=[1, 2], temperatures=[0.0, 1.0],
                                 max_tokens=8, runs=1, methods=methods, progress=False)
    rows = result["rows"]
    assert len(rows) == 2 * 2 * len(methods)
    for r in rows:
        assert {"method", "batch_size", "temperature", "tokens_per_s", "num_tokens"} <= r.keys()
        assert r["num_tokens"] == 8 * r["batch_size"]  # ignore_eos: every prompt emits max_tokens
        if r["method"] == "plain":
            continue
        assert {"speedup", "alpha", "mean_accepted_length", "mean_k", "c"} <= r.keys()
        assert 0 <= r["alpha"] <= 1
        if r["temperature"] == 0:
            assert r["greedy_identical"] is True, r
        else:
            assert "greedy_identical" not in r
    drafts = [r for r in rows if r["method"] == "draft k=2"]
    assert all(r["c"] is not None and r["c"] > 0 for r in drafts)
    assert all("share_of_ideal" in r for r in drafts if r["num_drafts"])


def test_markdown_table_has_a_line_per_row(bench):
    rows = [dict(method="plain", batch_size=1, temperature=0.0, tokens_per_s=100.0),
            dict(method="draft k=4", batch_size=1, temperature=0.0, tokens_per_s=200.0, speedup=2.0, alpha=0.8,
                 mean_accepted_length=3.4, mean_k=4.0, c=0.1, ideal_speedup=2.4, share_of_ideal=0.83,
                 greedy_identical=False)]
    lines = bench.markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert "**no**" in lines[-1]  # a mismatch stands out

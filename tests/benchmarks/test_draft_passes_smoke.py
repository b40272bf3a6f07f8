"""benchmarks/draft_passes.py on one short repeat: the four drafting engines and plain decoding
run every case, each drafting engine drafts as it says, and the results are written (under their
own name with --adaptive). No timing is asserted."""
from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_draft_passes_benchmark_runs_every_case(tmp_path, load_benchmark):
    bench = load_benchmark("draft_passes")
    llms = bench.build(str(ROOT / "models" / "demo"), str(ROOT / "models" / "demo-draft"), "off", 64)
    assert llms["pass by pass"].engine.draft_runner.passes is None
    native = llms["native"].engine.draft_runner.passes
    assert native is not None  # the native attention built here
    assert native.native is not None or not torch.ops.pdserve.linear_packed_available()
    assert llms["graphs"].engine.draft_runner.passes.native is None
    assert llms["native"].engine.speculator.proposer.catch_up_at_once
    assert not llms["catch-up apart"].engine.speculator.proposer.catch_up_at_once
    for extra, stem in (([], "draft_passes"), (["--adaptive"], "draft_passes_adaptive")):
        bench.main(["--repeats", "1", "--max-tokens", "4", "--graph-capture", "off", "--no-markdown",
                    "--out", str(tmp_path), *extra])
        result = json.loads((tmp_path / f"{stem}.json").read_text())
        assert result["adaptive"] == bool(extra)
        assert [(r["batch"], r["temperature"]) for r in result["rows"]] == list(bench.CASES)
        for r in result["rows"]:
            assert set(r["tokens_per_s"]) == set(bench.ENGINES) and all(v["min"] > 0 for v in r["tokens_per_s"].values())
            assert r["native_vs_graphs"]["min"] > 0 and r["native_vs_catch_up_apart"]["min"] > 0
        assert (tmp_path / f"{stem}.png").stat().st_size > 0

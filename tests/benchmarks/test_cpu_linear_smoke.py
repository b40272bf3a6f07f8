"""benchmarks/cpu_linear.py on one short repeat: every variant this CPU can run is timed at every
row count, checked against F.linear first, and written out. No timing is asserted."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.kernels import native


def test_cpu_linear_runs_every_variant(tmp_path, load_benchmark):
    bench = load_benchmark("cpu_linear")
    bench.main(["--repeats", "1", "--iters", "1", "--no-markdown", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cpu_linear.json").read_text())
    assert (tmp_path / "cpu_linear.png").stat().st_size > 0
    vector = native.load() and torch.ops.pdserve.linear_packed_available()
    expected = {"torch"} | ({"packed", "packed-bf16"} if vector else set())
    assert expected <= set(result["variants"])
    has_tiles = vector and torch.ops.pdserve.linear_tile_rows(160)  # a CPU with AMX
    assert ("packed-bf16-vector" in result["variants"]) == has_tiles
    flags = Path("/proc/cpuinfo").read_text()
    assert ("packed-avx2" in result["variants"]) == (" avx2" in flags and " fma" in flags)
    assert {(r["variant"], r["rows"]) for r in result["rows"]} == \
        {(v, m) for v in result["variants"] for m in bench.ROWS}
    assert all(r["ms"]["min"] > 0 for r in result["rows"])
    assert [n for _, n, _ in result["shapes"]][-1] == 4096  # the demo's lm_head: vocabulary × hidden

"""benchmarks/decode_k_layout.py on its quick cases: the program builds against the production
vector code, every variant's scores agree with row-major's (head_dim 32 and 128, 2 and 4 query
rows a KV head), every case is timed in both block orders and written out, and a case the program
cannot run is refused by name. No timing is asserted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
pytestmark = pytest.mark.skipif(not AVX512, reason="the production row-major key pass (dot16) is AVX-512's")


def test_decode_k_layout_times_every_variant_in_both_orders(tmp_path, load_benchmark):
    bench = load_benchmark("decode_k_layout")
    bench.main(["--quick", "--out", str(tmp_path)])
    assert not (tmp_path / "decode_k_layout.json").exists()  # a smoke run leaves the measured files alone
    result = json.loads((tmp_path / "decode_k_layout_quick.json").read_text())
    assert (tmp_path / "decode_k_layout_quick.png").stat().st_size > 0
    assert [(r["case"], r["order"]) for r in result["rows"]] == [
        (c[0], order) for c in bench.QUICK_CASES for order in ("in-order", "scattered")]
    for r in result["rows"]:
        assert set(r["ms"]) == set(bench.VARIANTS) and all(len(r["ms"][v]["values"]) == 2 for v in bench.VARIANTS)
        assert all(r["ms"][v]["min"] > 0 for v in bench.VARIANTS)
        assert set(r["speedup"]) == {"transposed", "dims-major"}
        assert max(r["max_abs_diff"].values()) <= bench.MAX_DIFF
        assert r["key_mib"] == 4 * r["head_dim"] * r["kv_heads"] * r["seqs"] * r["context"] * r["layers"] / 2**20
    assert result["read_gbps"] > 0 and result["command"].endswith("decode_k_layout.py --quick --out " + str(tmp_path))


def test_a_case_the_program_cannot_run_is_refused(tmp_path, load_benchmark):
    bench = load_benchmark("decode_k_layout")
    binary = bench.compile_program(tmp_path)
    with pytest.raises(SystemExit, match="group 1, 2, 4 or 6"):
        bench.measure(binary, ("three rows", 32, 2, 3, 1, 64, 1), "in-order", 1)
    with pytest.raises(SystemExit, match="head_dim 32, 64 or 128"):
        bench.measure(binary, ("head_dim 48", 48, 2, 2, 1, 64, 1), "in-order", 1)

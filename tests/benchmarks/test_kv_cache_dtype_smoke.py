"""benchmarks/kv_cache_dtype.py on one short repeat of its quick cases (the tiny model): both
caches timed in every case and written out, their sizes as the engines hold them. No timing is
asserted."""
from __future__ import annotations

import json


def test_kv_cache_dtype_times_both_caches_in_every_case(tmp_path, load_benchmark, checkpoint):
    bench = load_benchmark("kv_cache_dtype")
    bench.main(["--model", str(checkpoint("llama")), "--quick", "--repeats", "1", "--steps", "2",
                "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kv_cache_dtype.json").read_text())
    assert (tmp_path / "kv_cache_dtype.png").stat().st_size > 0
    assert [(r["kind"], r["batch"], r["context"]) for r in result["rows"]] == list(bench.QUICK_CASES)
    assert all(r["ms"][c]["min"] > 0 for r in result["rows"] for c in ("float32", "bfloat16"))
    # the tiny model: 2 layers of 2 KV heads of 16, K and V
    assert result["kv_bytes_per_token"] == {"float32": 2 * 2 * 2 * 16 * 4, "bfloat16": 2 * 2 * 2 * 16 * 2}
    assert result["blocks"]["bfloat16"] >= result["blocks"]["float32"]
    decode_tokens = sum(b * 2 for kind, b, _ in bench.QUICK_CASES if kind == "decode")  # one repeat, 2 steps
    assert result["compared_tokens"] == decode_tokens + sum(b for kind, b, _ in bench.QUICK_CASES if kind == "decode")


def test_kv_cache_dtype_times_a_float16_cache_into_files_of_its_own(tmp_path, load_benchmark, checkpoint):
    bench = load_benchmark("kv_cache_dtype")
    bench.main(["--model", str(checkpoint("llama")), "--quick", "--repeats", "1", "--steps", "2", "--narrow",
                "float16", "--out", str(tmp_path)])
    assert not (tmp_path / "kv_cache_dtype.json").exists()
    result = json.loads((tmp_path / "kv_cache_dtype_float16.json").read_text())
    assert result["narrow"] == "float16" and (tmp_path / "kv_cache_dtype_float16.png").stat().st_size > 0
    assert all(r["ms"][c]["min"] > 0 for r in result["rows"] for c in ("float32", "float16"))

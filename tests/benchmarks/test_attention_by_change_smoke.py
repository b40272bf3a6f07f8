"""benchmarks/attention_by_change.py on its quick cases, the checkout's revision against itself:
each variant runs in processes of its own from an exported revision, every case is timed for
both in every repeat and written out; malformed variants are refused by name. No timing is
asserted."""
from __future__ import annotations

import json

import pytest


def test_a_revision_against_itself_times_every_case_for_both(tmp_path, load_benchmark):
    bench = load_benchmark("attention_by_change")
    bench.main(["--variant", "base=HEAD", "--variant", "again=HEAD", "--quick", "--out", str(tmp_path)])
    assert not (tmp_path / "attention_by_change.json").exists()  # a smoke run leaves the measured files alone
    result = json.loads((tmp_path / "attention_by_change_quick.json").read_text())
    assert (tmp_path / "attention_by_change_quick.png").stat().st_size > 0
    assert [v["name"] for v in result["variants"]] == ["base", "again"]
    assert result["variants"][0]["subject"] == result["variants"][1]["subject"]  # both HEAD
    assert [r["case"] for r in result["rows"]] == [c[0] for c in bench.QUICK_CASES]
    for r in result["rows"]:
        assert all(len(r["ms"][n]["values"]) == 2 and r["ms"][n]["min"] > 0 for n in ("base", "again"))
        assert set(r["speedup"]) == {"again"} and r["speedup"]["again"]["min"] > 0


@pytest.mark.parametrize("variants", [["only=HEAD"], ["a=HEAD", "a=HEAD"], ["HEAD", "b=HEAD"]])
def test_malformed_variants_are_refused(load_benchmark, variants, capsys):
    bench = load_benchmark("attention_by_change")
    with pytest.raises(SystemExit):
        bench.main([arg for v in variants for arg in ("--variant", v)])
    assert "--variant" in capsys.readouterr().err


def test_a_verification_step_is_timed_with_its_queries(tmp_path, load_benchmark):
    bench = load_benchmark("attention_by_change")
    bench.main(["--variant", "base=HEAD", "--variant", "again=HEAD", "--quick", "--queries", "3", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "attention_by_change_quick_q3.json").read_text())
    assert result["queries"] == 3 and (tmp_path / "attention_by_change_quick_q3.png").stat().st_size > 0
    assert all(r["ms"][n]["min"] > 0 for r in result["rows"] for n in ("base", "again"))


@pytest.mark.parametrize("queries", ["0", "17"])
def test_queries_out_of_range_are_refused(load_benchmark, queries, capsys):
    bench = load_benchmark("attention_by_change")
    with pytest.raises(SystemExit):
        bench.main(["--variant", "a=HEAD", "--variant", "b=HEAD", "--queries", queries])
    assert "--queries" in capsys.readouterr().err

"""benchmarks/spec_by_revision.py's --cases: each BATCH:TEMPERATURE becomes a plain and a
speculating case, and a malformed one is refused with a message naming it (the measurement
itself, two engines per revision, is too long for the suite)."""
from __future__ import annotations

import pytest


def test_cases_are_plain_and_speculating_per_batch_and_temperature(load_benchmark):
    bench = load_benchmark("spec_by_revision")
    assert bench.cases_of(bench.DEFAULT_CASES) == [("plain", 1, 0.0), ("spec", 1, 0.0),
                                                   ("plain", 8, 1.0), ("spec", 8, 1.0)]
    assert bench.cases_of(["32:0"]) == [("plain", 32, 0.0), ("spec", 32, 0.0)]


@pytest.mark.parametrize("spec", ["32", "x:1", "0:1", "64:0", "8:-1"])
def test_a_malformed_case_is_refused_by_name(load_benchmark, spec):
    bench = load_benchmark("spec_by_revision")
    with pytest.raises(ValueError, match=repr(spec).replace("(", r"\(")):
        bench.cases_of([spec])


def test_the_command_line_refuses_a_malformed_case_before_building_anything():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_by_revision.py"
    proc = subprocess.run([sys.executable, str(script), "--baseline", "HEAD", "--cases", "8:1", "eight:1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "'eight:1'" in proc.stderr

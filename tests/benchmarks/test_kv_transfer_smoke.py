"""benchmarks/kv_transfer.py --quick --skip-ttft: every KV path into a real decode worker, small
sizes. No timing is asserted: each path moved the prompt's bytes, and a run without the TTFT part
reports no TTFT verdict and leaves the full run's files alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_the_paths_run_and_a_run_without_ttft_says_so():
    full = (RESULTS / "kv_transfer.json").read_bytes()
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kv_transfer.py"), "--quick", "--skip-ttft"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((RESULTS / "kv_transfer_paths_quick.json").read_text())
    paths = result["paths"]
    # K and V of the 512-token prompt in each of the 4 layers
    assert paths["prompt_tokens"] == 512 and paths["layers"] == 4 and paths["kv_dtype"] == "float32"
    assert paths["kv_bytes"] == 2 * 4 * 512 * paths["kv_row_elements"] * 4
    for name in ("grpc", "tcp", "shm", "copy"):
        assert len(paths["seconds"][name]["values"]) == 5 and min(paths["seconds"][name]["values"]) > 0
    assert result["ttft"] is None
    assert "TTFT: not measured in this run" in proc.stdout and "| TTFT" not in proc.stdout
    assert (RESULTS / "kv_transfer.json").read_bytes() == full



def test_a_16_bit_cache_moves_two_bytes_a_value_on_every_path(tmp_path):
    """--kv-cache-dtype bfloat16: every worker's cache is 16-bit under the float32 model; the run
    writes its own files where --out says, and each path moved the prompt's K/V at two bytes a
    value (half the float32 cache's)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kv_transfer.py"), "--quick", "--skip-ttft",
                           "--kv-cache-dtype", "bfloat16", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "kv_transfer_bfloat16_paths_quick.json").read_text())
    assert (tmp_path / "kv_transfer_bfloat16_paths_quick.png").stat().st_size > 0 and str(tmp_path) in proc.stdout
    paths = result["paths"]
    assert paths["kv_dtype"] == "bfloat16"
    assert paths["kv_bytes"] == 2 * paths["layers"] * paths["prompt_tokens"] * paths["kv_row_elements"] * 2
    for name in ("grpc", "tcp", "shm", "copy", "dist"):
        assert min(paths["seconds"][name]["values"]) > 0, name

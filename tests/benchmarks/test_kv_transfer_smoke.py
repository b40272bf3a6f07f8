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
    assert paths["prompt_tokens"] == 512 and paths["layers"] == 4 and paths["kv_bytes"] % (2 * 4 * 512) == 0
    for name in ("grpc", "tcp", "shm", "copy"):
        assert len(paths["seconds"][name]["values"]) == 5 and min(paths["seconds"][name]["values"]) > 0
    assert result["ttft"] is None
    assert "TTFT: not measured in this run" in proc.stdout and "| TTFT" not in proc.stdout
    assert (RESULTS / "kv_transfer.json").read_bytes() == full

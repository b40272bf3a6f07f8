"""benchmarks/multi_turn.py --quick: two real disaggregated pairs, one whose decode worker keeps
no prefix cache. No timing is asserted: what the decode workers received and found is."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_later_turns_receive_only_what_the_decode_worker_lacks():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "multi_turn.py"), "--quick"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (rep,) = json.loads((REPO / "benchmarks" / "results" / "multi_turn_quick.json").read_text())["repeats"]
    reuse, plain = rep["reuse"], rep["no reuse"]
    assert all(n == 0 for n in plain["hit_tokens"]) and all(n > 0 for n in reuse["hit_tokens"])
    # the history's tokens found are the bytes not received: the same K/V bytes per token in both
    per_token = plain["kv_bytes"][0] / (256 + 32 + 64)  # the second turn's prompt, whole
    assert reuse["kv_bytes"] == [plain_b - n * per_token for plain_b, n in zip(plain["kv_bytes"],
                                                                                             reuse["hit_tokens"])]
    assert "| reuse |" in proc.stdout and "KV bytes received" in proc.stdout

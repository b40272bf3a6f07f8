"""benchmarks/multi_turn.py --quick: three real disaggregated pairs, whose decode workers prefill a
later turn's tail themselves, leave it to the prefill worker, or keep no prefix cache. No timing
is asserted: what the decode workers received and found, and what the prefill workers computed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_later_turns_receive_only_what_the_decode_worker_lacks_or_nothing():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "multi_turn.py"), "--quick"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (rep,) = json.loads((REPO / "benchmarks" / "results" / "multi_turn_quick.json").read_text())["repeats"]
    local, push, plain = rep["local prefill"], rep["push"], rep["no reuse"]
    assert all(n == 0 for n in plain["hit_tokens"]) and all(n > 0 for n in push["hit_tokens"])
    assert local["hit_tokens"] == push["hit_tokens"]  # the same blocks found, the same answers before
    # the history's tokens found are the bytes not received: the same K/V bytes per token in both
    prompt = 256 + 32 + 64  # the second turn's, whole
    per_token = plain["kv_bytes"][0] / prompt
    assert push["kv_bytes"] == [plain_b - n * per_token for plain_b, n in zip(plain["kv_bytes"], push["hit_tokens"])]
    # the tail (the 64-token question and the answer's last partial block) prefilled where the rest is
    assert local["kv_bytes"] == [0] * len(push["kv_bytes"]) and local["prefill_tokens"] == local["kv_bytes"]
    assert push["prefill_tokens"] == plain["prefill_tokens"] and push["prefill_tokens"][0] > 0
    assert "| local prefill |" in proc.stdout and "KV bytes received" in proc.stdout

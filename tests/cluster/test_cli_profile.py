"""`pdserve profile` on a tiny checkpoint (quick grid): a loadable cost profile whose numbers
are positive and whose notes say how each was found and where it ran; bad pinning is exit 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdserve.loadgen.costs import CostProfile

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def test_profile_writes_a_cost_profile_pinned_as_asked(checkpoint, tmp_path):
    model = str(checkpoint("llama", seed=3))
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run([PDSERVE, "profile", "--model", model, "--draft-model", model, "--num-speculative-tokens",
                          "2", "--quick", "--cpus", str(cpu), "--num-threads", "1", "--max-num-seqs", "8",
                          "--output", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    p = CostProfile.load(tmp_path / "p.json")
    assert p.prefill.fixed_s + p.prefill.per_token_s > 0 and p.decode.fixed_s + p.decode.per_seq_s > 0
    assert p.transfer.kv_bytes_per_token == 2 * 2 * (2 * 2 * 16 * 4)  # (target + draft) K,V, 2 layers, 2 heads x 16
    assert p.transfer.bandwidth_bytes_per_s > 0 and p.limits.max_num_seqs == 8
    spec = p.speculation
    assert spec.num_speculative_tokens == 2 and spec.step is not None and spec.draft_cost_ratio > 0
    assert spec.prefill is not None and "prefill_with_draft" in p.measurements
    assert spec.acceptance_rate > 0.9  # the model drafting for itself, greedy: every draft accepted
    assert f"cpus [{cpu}], 1 torch thread(s)" in p.notes["decode"] and "measured" in p.notes["transfer"]
    assert {"prefill", "decode", "speculative", "draft"} <= set(p.measurements)


def test_profile_refuses_cores_it_may_not_use(checkpoint, tmp_path):
    out = subprocess.run([PDSERVE, "profile", "--model", str(checkpoint("llama", seed=3)), "--cpus", "4096",
                          "--output", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--cpus [4096]" in out.stderr and "Traceback" not in out.stderr


def test_a_16_bit_kv_cache_halves_the_profiles_transfer_bytes(checkpoint):
    """`pdserve profile --kv-cache-dtype bfloat16`: the workers' caches, so what a transfer moves."""
    from pdserve.cluster.profile import ProfileConfig, kv_bytes_per_token

    model = str(checkpoint("llama", seed=3))
    wide = kv_bytes_per_token(ProfileConfig(model, model, device="cpu"))
    assert wide == 2 * 2 * (2 * 2 * 16 * 4)
    assert kv_bytes_per_token(ProfileConfig(model, model, device="cpu", kv_cache_dtype="bfloat16")) == wide // 2
    assert ProfileConfig(model, kv_cache_dtype="bfloat16").engine_options()["kv_cache_dtype"] == "bfloat16"

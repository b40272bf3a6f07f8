"""The offline-throughput benchmark runs end to end on a tiny model. No timing is asserted."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "offline_throughput.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("offline_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_offline_throughput_smoke(tmp_path):
    ot = load_bench()
    tiny = ot.ModelSpec("tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=211, max_position_embeddings=256)
    cfg = ot.BenchConfig(models=(tiny,), repeats=1, b1_prompt_len=8, b1_new_tokens=4, num_prompts=5,
                         min_prompt_len=3, max_prompt_len=20, min_max_tokens=1, max_max_tokens=9,
                         hf_batch_size=3, bandwidth_mb=8, cache_dir=tmp_path / "cache")
    result = ot.run_benchmark(cfg, progress=False)
    (model,) = result["models"]
    pd, hf = model["systems"]["pdserve"], model["systems"]["transformers"]
    asked = sum(model["mixed_workload"]["max_tokens"])
    assert pd["mixed"]["useful_tokens"] == hf["mixed"]["useful_tokens"] == asked
    assert pd["batch1"]["tokens"] == hf["batch1"]["tokens"] == 4
    assert model["mixed_workload"]["hf_generated_tokens"] >= asked
    # the batch-1 greedy run is the engine's correctness contract with transformers
    assert model["greedy_agreement"]["b1_full"] == 1.0

    ot.write_json(result, tmp_path, "out")
    ot.write_plot(result, tmp_path, "out")
    ot.update_markdown(result, "python benchmarks/offline_throughput.py --test", tmp_path / "BENCHMARKS.md")
    written = json.loads((tmp_path / "out.json").read_text())
    assert {"benchmark", "config", "machine", "copy_bandwidth_gbps", "models"} <= written.keys()
    assert {"model", "decode_floor_ms", "systems", "ratios", "goals", "greedy_agreement", "paired_ratios",
            "mixed_workload"} <= written["models"][0].keys()
    assert {"mixed_throughput", "batch1_latency", "batch1_throughput", "batch1_decode_step"} <= model["ratios"].keys()
    assert (tmp_path / "out.png").stat().st_size > 0
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md.count(ot.SECTION) == 1 and "--test" in md
    ot.update_markdown(result, "python benchmarks/offline_throughput.py --again", tmp_path / "BENCHMARKS.md")
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md.count(ot.SECTION) == 1 and "--again" in md and "--test" not in md

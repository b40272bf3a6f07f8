"""benchmarks/profile_offline.py: variant specs parse, and a revision unpacks as an importable
`pdserve` (what its side-by-side mode runs). No timing is asserted."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_variant_specs_parse(load_benchmark):
    po = load_benchmark("profile_offline")
    assert po.parse_variant("base=cc75024") == ("base", "cc75024", {})
    assert po.parse_variant("c=HEAD:graph_capture=compile,num_kv_blocks=64,spec_adaptive=false") == \
        ("c", "HEAD", {"graph_capture": "compile", "num_kv_blocks": 64, "spec_adaptive": False})
    _, _, options = po.parse_variant("s=HEAD:draft_model=models/demo-draft")
    assert options["draft_model"] == str(ROOT / "models" / "demo-draft")


def test_a_revision_unpacks_as_the_pdserve_package(tmp_path, load_benchmark):
    po = load_benchmark("profile_offline")
    path, subject = po.unpack("HEAD", tmp_path)
    assert subject.split()[0] and (path / "pdserve" / "engine" / "llm_engine.py").is_file()
    env = dict(os.environ, PYTHONPATH=str(path))
    out = subprocess.run([sys.executable, "-c", "import pdserve.engine as e; print(e.__file__)"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(str(path)), out.stderr  # not the installed checkout


def test_prompt_lengths_parse_or_are_refused_by_name(load_benchmark):
    import argparse

    import pytest

    po = load_benchmark("profile_offline")
    assert po._lengths("32,128, 512") == [32, 128, 512]
    for bad in ("", "0,8", "32,abc"):
        with pytest.raises(argparse.ArgumentTypeError, match="prompt lengths"):
            po._lengths(bad)


def test_batch_prompts_are_distinct_and_keep_the_length(load_benchmark):
    po = load_benchmark("profile_offline")
    prompt = [3, 4, 5, 99, 127]
    prompts = po.batch_prompts(prompt, 4, vocab=128)
    assert prompts[0] == prompt and len({tuple(p) for p in prompts}) == 4
    assert all(len(p) == len(prompt) and min(p) >= 3 and max(p) < 128 for p in prompts)
    assert po.batch_prompts(prompt, 1, vocab=128) == [prompt]


def test_side_by_side_times_prefills_per_prompt_length(tmp_path, load_benchmark, checkpoint):
    """One variant (this checkout's HEAD) on a tiny checkpoint, two repeats, a batch of two: every
    prompt length gets a prefill time per repeat and a speedup of 1 against itself, and both
    tables render, naming the batch and the torch threads the variants ran on."""
    po = load_benchmark("profile_offline")
    result = po.compare(["head=HEAD"], checkpoint("llama"), repeats=2, new_tokens=5, prompt_lens=[20, 40], threads=2,
                        batch=2)
    prefill = result["variants"]["head"]["prefill_ms"]
    assert set(prefill) == {"20", "40"}
    for n in prefill.values():
        assert len(n["ms"]["values"]) == 2 and min(n["ms"]["values"]) > 0
        assert list(n["speedup"]["values"]) == [1.0, 1.0]
    text = po.prefill_markdown(result, "cmd")
    assert "| head |" in text and "40 tokens: speedup" in text and "2 torch threads" in text
    assert "| head |" in po.markdown(result, "cmd") and "2 torch threads" in po.markdown(result, "cmd")
    assert "Batch-2 greedy decode step" in po.markdown(result, "cmd") and result["batch"] == 2
    assert min(result["variants"]["head"]["wall_ms"]["values"]) > 0


def test_side_by_side_samples_at_a_temperature(load_benchmark, checkpoint):
    """--temperature: the variants sample (seeded requests) and the table says so."""
    po = load_benchmark("profile_offline")
    result = po.compare(["head=HEAD"], checkpoint("llama"), repeats=1, new_tokens=4, batch=2, temperature=1.0)
    assert result["temperature"] == 1.0 and min(result["variants"]["head"]["wall_ms"]["values"]) > 0
    assert "Batch-2 temperature-1 decode step" in po.markdown(result, "cmd")


def test_a_run_without_markdown_writes_partial_files(load_benchmark):
    """--no-markdown leaves the files the BENCHMARKS table came from alone, as spec_decode.py does."""
    po = load_benchmark("profile_offline")
    assert po.outputs(False, False)[:2] == ("step_by_change", po.SECTION)
    assert po.outputs(True, False)[:2] == ("prefill_by_change", po.PREFILL_SECTION)
    assert po.outputs(False, True)[0] == "step_by_change_partial"
    assert po.outputs(True, True)[0] == "prefill_by_change_partial"

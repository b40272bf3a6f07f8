"""`pdserve generate` streams a completion to stdout, and bad input exits 2 with one clear line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.engine import LLM, SamplingParams

PDSERVE = str(Path(sys.executable).with_name("pdserve"))  # the installed command, as users run it


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PDSERVE, *args], capture_output=True, text=True,
                          timeout=120)


def test_generate_streams_the_offline_completion(text_checkpoint):
    out = run_cli("generate", "--model", str(text_checkpoint), "--prompt", "def ", "--max-tokens", "8",
                  "--temperature", "0")
    assert out.returncode == 0, out.stderr
    want = LLM(text_checkpoint).generate(["def "], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.stdout == "def " + want.text + "\n"
    assert f"[{len(want.token_ids)} tokens, finish_reason={want.finish_reason_str}" in out.stderr


def test_generate_with_speculation_prints_its_stats(text_checkpoint):
    out = run_cli("generate", "--model", str(text_checkpoint), "--draft-model", str(text_checkpoint),
                  "--num-speculative-tokens", "3", "--no-spec-adaptive", "--prompt", "def ", "--max-tokens", "12",
                  "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert "speculative:" in out.stderr and "draft tokens accepted" in out.stderr


def test_generate_takes_the_rejection_verifier(text_checkpoint):
    """--spec-verifier reaches the engine: a seeded sampled completion under the rejection sampler
    is the offline engine's with the same option; a verifier it does not know exits 2."""
    args = ("generate", "--model", str(text_checkpoint), "--draft-model", str(text_checkpoint),
            "--num-speculative-tokens", "3", "--no-spec-adaptive", "--prompt", "def ", "--max-tokens", "12",
            "--temperature", "1", "--seed", "4")
    out = run_cli(*args, "--spec-verifier", "rejection")
    assert out.returncode == 0, out.stderr
    llm = LLM(text_checkpoint, draft_model=text_checkpoint, num_speculative_tokens=3, spec_adaptive=False,
              spec_verifier="rejection")
    want = llm.generate(["def "], SamplingParams(temperature=1, max_tokens=12, seed=4))[0]
    assert out.stdout == "def " + want.text + "\n" and "speculative:" in out.stderr
    bad = run_cli(*args, "--spec-verifier", "maybe")
    assert bad.returncode == 2 and "--spec-verifier" in bad.stderr and "invalid choice" in bad.stderr


def test_generate_with_a_compiled_forward_gives_the_same_completion(text_checkpoint):
    """--graph-capture reaches the engine: compiled, the greedy completion is the eager one."""
    args = ("generate", "--model", str(text_checkpoint), "--prompt", "def ", "--max-tokens", "8", "--temperature", "0")
    eager, compiled = run_cli(*args), run_cli(*args, "--graph-capture", "compile")
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == eager.stdout
    bad = run_cli(*args, "--graph-capture", "sometimes")
    assert bad.returncode == 2 and "--graph-capture" in bad.stderr and "invalid choice" in bad.stderr


def test_bad_input_exits_2_with_a_clear_message(tmp_path, text_checkpoint):
    missing = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    bad_top_p = run_cli("generate", "--model", str(text_checkpoint), "--prompt", "x", "--top-p", "2")
    assert bad_top_p.returncode == 2 and "SamplingParams.top_p" in bad_top_p.stderr and bad_top_p.stdout == ""

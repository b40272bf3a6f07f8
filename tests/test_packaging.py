"""The distribution: one import root, `pdserve`, built from a clean copy of the checkout, that
works beside the packages whose names the folders share (proto-plus's `proto`, Hugging Face's
`kernels`)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> where its modules land in the wheel
MAPPED = {"engine": "pdserve/engine", "kernels": "pdserve/kernels", "serving": "pdserve/serving",
          "prefill_worker": "pdserve/prefill_worker", "decode_worker": "pdserve/decode_worker",
          "router": "pdserve/router", "client": "pdserve/client", "loadgen": "pdserve/loadgen",
          "cluster": "pdserve/cluster", "proto/pdserve": "pdserve"}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout's files (what a clean clone holds)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for f in tracked_files():
        if f.startswith(("models/", "benchmarks/results/")):
            continue  # large, and not part of the distribution
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("pdserve-*.whl")
    return path


def test_the_wheel_installs_exactly_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"pdserve"}, tops
    for folder, target in MAPPED.items():
        for f in tracked_files():
            if f.startswith(folder + "/") and f.endswith((".py", ".proto", ".cpp", ".h")):
                assert f"{target}/{f[len(folder) + 1:]}" in names, f"{f} is missing from the wheel"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "pdserve = pdserve.cluster.cli:main" in entry_points


def test_the_installed_wheel_runs_without_the_checkout(wheel, tmp_path, text_checkpoint):
    """Unpacked alone on sys.path (no site hooks, so not the editable install), it imports and
    runs `pdserve generate` with the test environment's dependencies."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    deps = sysconfig.get_paths()["purelib"]
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import pdserve, pdserve.v1.worker_pb2; "
            "assert pdserve.__file__.startswith(sys.argv[1]), pdserve.__file__; "
            "from pdserve.cluster.cli import main; sys.exit(main(sys.argv[3:]))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(site), deps, "generate", "--model",
                          str(text_checkpoint), "--prompt", "def ", "--max-tokens", "4", "--temperature", "0",
                          "--cpu-attention", "native"],  # its C++ source shipped in the wheel
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def ") and "finish_reason=length" in out.stderr


@pytest.mark.parametrize("extra_path", [None, "benchmarks"])
def test_pdserve_coexists_with_proto_plus_and_hf_kernels(extra_path):
    """proto-plus (pulled in by ray[default]) owns the name `proto`, Hugging Face owns `kernels`:
    both stay theirs, pdserve's modules stay ours, also with benchmarks/ first on sys.path."""
    pytest.importorskip("proto", reason="proto-plus is a test dependency")
    code = """
import sys
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
import proto, kernels
assert hasattr(proto, "Message") and hasattr(kernels, "get_kernel"), (proto.__file__, kernels.__file__)
import pdserve.v1.worker_pb2, pdserve.kernels, pdserve.engine
assert pdserve.kernels.select_ops and pdserve.engine.LLM
import transformers
transformers.LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
"""
    args = [str(ROOT / extra_path)] if extra_path else []
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr

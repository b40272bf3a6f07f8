"""DESIGN.md's import rules, checked by walking every module's imports with `ast`, and the
torch-free packages checked at run time. No exceptions are carved out."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> its subpackage of pdserve (pdserve.v1 lives in proto/pdserve/v1)
FOLDERS = {"engine": "engine", "kernels": "kernels", "serving": "serving", "prefill_worker": "prefill_worker",
           "decode_worker": "decode_worker", "router": "router", "client": "client", "loadgen": "loadgen",
           "cluster": "cluster", "proto/pdserve/v1": "v1"}
# which of our subpackages each may import (itself always)
ALLOWED = {
    "engine": {"kernels"},
    "kernels": set(),
    "serving": {"engine", "v1"},
    "prefill_worker": {"engine", "serving", "v1"},
    "decode_worker": {"engine", "serving", "v1"},
    "router": {"v1", "serving", "engine"},  # engine and serving: torch-free modules only (below)
    "client": {"v1"},
    "loadgen": {"client", "v1"},
    "cluster": {"engine", "kernels", "serving", "prefill_worker", "decode_worker", "router", "client", "loadgen", "v1"},
    "v1": set(),
}
THIRD_PARTY_BANNED = {
    "engine": {"grpc", "grpc_health", "grpc_reflection", "ray", "prometheus_client", "aiohttp"},
    "kernels": {"grpc", "ray", "prometheus_client", "aiohttp"},
    "router": {"torch", "triton"},
    "client": {"torch", "triton"},
    "loadgen": {"torch", "triton"},
}
ONLY_CLUSTER_IMPORTS = {"ray"}
# the router may use only these torch-free engine modules
ROUTER_ENGINE_MODULES = {"pdserve.engine.tokenizer", "pdserve.engine.detokenizer", "pdserve.engine.sampling_params"}
TORCH_FREE_PACKAGES = ("pdserve.router", "pdserve.client", "pdserve.loadgen")


def imports_of(path: Path) -> set[str]:
    """Absolute module names a file imports (at any depth, lazily too); relative imports are
    reported as '.' + module so the check can refuse them."""
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mods.add("." * node.level + (node.module or ""))
            elif node.module:
                mods.add(node.module)
                mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def package_files(folder: str) -> list[Path]:
    return [p for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name]


def problems_of(pkg: str, path: Path) -> list[str]:
    problems = []
    where = path.relative_to(ROOT)
    for mod in sorted(imports_of(path)):
        parts = mod.split(".")
        if mod.startswith("."):
            problems.append(f"{where}: relative import {mod}")
        elif parts[0] in FOLDERS.values() or parts[0] == "proto":
            problems.append(f"{where}: imports {mod} outside the pdserve root")
        elif parts[0] == "pdserve" and len(parts) > 1:
            sub = parts[1]
            if sub != pkg and sub not in ALLOWED[pkg] and sub != "__version__":
                problems.append(f"{where}: imports {mod}")
            if pkg == "router" and sub == "engine" and not any(mod == m or mod.startswith(m + ".")
                                                                for m in ROUTER_ENGINE_MODULES):
                problems.append(f"{where}: imports {mod} (not a torch-free engine module)")
        if parts[0] in THIRD_PARTY_BANNED.get(pkg, ()):
            problems.append(f"{where}: imports {mod}")
        if parts[0] in ONLY_CLUSTER_IMPORTS and pkg != "cluster":
            problems.append(f"{where}: imports {mod} (only cluster/ imports it)")
    return problems


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_imports_follow_design(folder):
    if not (ROOT / folder).is_dir():
        pytest.skip(f"{folder}/ does not exist yet")
    pkg = FOLDERS[folder]
    problems = [p for path in package_files(folder) for p in problems_of(pkg, path)]
    assert not problems, "\n".join(problems)


def test_the_workers_never_import_each_other():
    assert "decode_worker" not in ALLOWED["prefill_worker"] and "prefill_worker" not in ALLOWED["decode_worker"]


@pytest.mark.parametrize("source, expected", [
    ("import grpc\n", "engine/x.py: imports grpc"),
    ("from pdserve.decode_worker.server import X\n", "prefill_worker/x.py: imports pdserve.decode_worker.server"),
    ("from pdserve.engine.llm_engine import LLMEngine\n", "not a torch-free engine module"),
    ("import ray\n", "only cluster/ imports it"),
    ("from engine import LLM\n", "outside the pdserve root"),
    ("from . import sibling\n", "relative import ."),
    ("def f():\n    import torch\n", "router/x.py: imports torch"),
])
def test_the_checker_catches_a_violation(tmp_path, source, expected):
    pkg = {"engine/x.py": "engine", "prefill_worker/x.py": "prefill_worker"}.get(expected.split(":")[0], "router")
    folder = ROOT / "tests" / ".layering_probe"  # problems_of reports paths relative to the repository
    folder.mkdir(exist_ok=True)
    try:
        path = folder / "x.py"
        path.write_text(source)
        found = problems_of(pkg, path)
    finally:
        path.unlink(missing_ok=True)
        folder.rmdir()
    assert any(expected.split(": ", 1)[-1] in p for p in found), found


def test_torch_free_packages_load_no_torch_at_run_time():
    """Import every module of the router, client and load generator (and so everything they
    import, serving and engine modules included) and check torch was never loaded."""
    code = f"""
import importlib, pkgutil, sys
for name in {TORCH_FREE_PACKAGES!r}:
    try:
        pkg = importlib.import_module(name)
    except ModuleNotFoundError:
        continue
    for m in pkgutil.walk_packages(pkg.__path__, name + "."):
        importlib.import_module(m.name)
bad = sorted(m for m in ("torch", "triton") if m in sys.modules)
assert not bad, f"imported {{bad}}"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr

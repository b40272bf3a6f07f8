"""DESIGN.md's import rules, checked by walking every module's imports with `ast`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"engine", "kernels", "prefill_worker", "decode_worker", "router", "cluster", "proto", "benchmarks"}
THIRD_PARTY_BANNED = {
    "engine": {"grpc", "ray", "prometheus_client"},
    "kernels": {"grpc", "ray", "prometheus_client"},
    "router": {"torch", "triton", "ray"},
    "proto": {"torch"},
}
# which of our packages each package may import
ALLOWED = {
    "engine": {"engine", "kernels"},
    "kernels": {"kernels"},
    "prefill_worker": {"prefill_worker", "engine", "kernels", "proto"},
    "decode_worker": {"decode_worker", "engine", "kernels", "proto"},
    "router": {"router", "proto", "cluster", "engine"},
    "cluster": {"cluster", "proto", "prefill_worker", "decode_worker", "router", "engine"},
    "proto": {"proto"},
}
# the router may use only the engine's torch-free modules
ROUTER_ENGINE_MODULES = {"engine.tokenizer", "engine.detokenizer", "engine.sampling_params"}


def imports_of(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def package_files(pkg: str) -> list[Path]:
    return [p for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_imports_follow_design(pkg):
    problems = []
    for path in package_files(pkg):
        for mod in imports_of(path):
            top = mod.split(".")[0]
            if top in OURS and top not in ALLOWED[pkg]:
                problems.append(f"{path.relative_to(ROOT)} imports {mod}")
            if top in THIRD_PARTY_BANNED.get(pkg, ()):
                problems.append(f"{path.relative_to(ROOT)} imports {mod}")
            if pkg == "router" and top == "engine" and mod != "engine" and not any(
                    mod == m or mod.startswith(m + ".") for m in ROUTER_ENGINE_MODULES):
                problems.append(f"{path.relative_to(ROOT)} imports {mod} (not torch-free)")
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import grpc\nfrom decode_worker.server import X\n")
    assert {"grpc", "decode_worker.server", "decode_worker.server.X"} <= imports_of(bad)


def test_torch_free_engine_modules_import_without_torch():
    import subprocess
    import sys

    code = ("import sys; import engine.tokenizer, engine.detokenizer, engine.sampling_params; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_refuses_a_foreign_proto_package(tmp_path):
    """With another `proto` first on sys.path (as proto-plus installs), servers fail clearly."""
    import subprocess
    import sys

    (tmp_path / "proto").mkdir()
    (tmp_path / "proto" / "__init__.py").write_text("")
    code = "import sys; sys.path.insert(0, sys.argv[1]); from cluster.cli import main; sys.exit(main(sys.argv[2:]))"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), "router", "--model", "x", "--decode", "a:1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not pdserve's (proto-plus" in out.stderr

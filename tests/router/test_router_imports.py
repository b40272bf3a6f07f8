"""The router runs without torch: importing its whole server path loads no torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_router_does_not_import_torch():
    code = ("import sys, router.main, router.server, router.workers, router.validate, cluster.cli; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_workers_do_not_import_each_other():
    import ast

    for pkg, other in (("prefill_worker", "decode_worker"), ("decode_worker", "prefill_worker"),
                       ("router", "prefill_worker"), ("router", "decode_worker")):
        for path in (REPO / pkg).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not any(n == other or n.startswith(other + ".") for n in names), f"{path} imports {other}"

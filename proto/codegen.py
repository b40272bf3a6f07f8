"""Regenerate the `*_pb2.py` / `*_pb2_grpc.py` modules beside the `.proto` files.

`python -m proto.codegen [OUT_DIR]`. protoc writes absolute imports (`from pdserve.v1 import
generation_pb2`), which only work with `proto/` on sys.path; they are rewritten to relative ones
so `import proto.pdserve.v1.generation_pb2` works from the repository root.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = "pdserve/v1"
_ABSOLUTE_IMPORT = re.compile(r"^from pdserve\.v1 import (\w+_pb2)", re.MULTILINE)


def proto_files() -> list[str]:
    return sorted(f"{PACKAGE_DIR}/{p.name}" for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules under out_dir/pdserve/v1; returns their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    paths = sorted((out_dir / PACKAGE_DIR).glob("*_pb2*.py"))
    for path in paths:
        path.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1", path.read_text()))
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for p in generate(target):
        print(p)

"""Regenerate the `*_pb2.py` / `*_pb2_grpc.py` modules beside the `.proto` files.

`python -m pdserve.serving.codegen [OUT_DIR]`. The `.proto` files sit in `proto/pdserve/v1/`,
the folder that installs as the `pdserve.v1` package, so protoc's own absolute imports
(`from pdserve.v1 import generation_pb2`) work as written: its output is committed unmodified,
and a test checks that regenerating changes nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pdserve.v1

PACKAGE_DIR = Path(pdserve.v1.__file__).resolve().parent  # proto/pdserve/v1 in a checkout
PROTO_ROOT = PACKAGE_DIR.parents[1]  # the -I root: the import path of each .proto starts here


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules under out_dir/pdserve/v1; returns their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / PACKAGE_DIR.relative_to(PROTO_ROOT)).glob("*_pb2*.py"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for p in generate(target):
        print(p)

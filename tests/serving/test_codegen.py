"""The committed generated modules are exactly what `python -m pdserve.serving.codegen` writes."""
from __future__ import annotations

from pathlib import Path

from pdserve.serving.codegen import PACKAGE_DIR, generate


def test_regenerating_changes_nothing(tmp_path):
    fresh = generate(tmp_path)
    assert {p.name for p in fresh} == {"generation_pb2.py", "generation_pb2_grpc.py", "worker_pb2.py",
                                       "worker_pb2_grpc.py"}
    for path in fresh:
        committed = PACKAGE_DIR / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run python -m pdserve.serving.codegen"


def test_generated_modules_import_as_a_package():
    import pdserve.v1.generation_pb2_grpc as gen_grpc
    import pdserve.v1.worker_pb2 as worker_pb2

    assert PACKAGE_DIR == Path(__file__).resolve().parents[2] / "proto" / "pdserve" / "v1"

    assert gen_grpc.GenerationStub and worker_pb2.KVChunk.DESCRIPTOR.full_name == "pdserve.v1.KVChunk"

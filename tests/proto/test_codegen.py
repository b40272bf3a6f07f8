"""The committed generated modules are exactly what `python -m proto.codegen` writes."""
from __future__ import annotations

from proto.codegen import PACKAGE_DIR, PROTO_ROOT, generate


def test_regenerating_changes_nothing(tmp_path):
    fresh = generate(tmp_path)
    assert {p.name for p in fresh} == {"generation_pb2.py", "generation_pb2_grpc.py", "worker_pb2.py",
                                       "worker_pb2_grpc.py"}
    for path in fresh:
        committed = PROTO_ROOT / PACKAGE_DIR / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run python -m proto.codegen"


def test_generated_modules_import_as_a_package():
    import proto.pdserve.v1.generation_pb2_grpc as gen_grpc
    import proto.pdserve.v1.worker_pb2 as worker_pb2

    assert gen_grpc.GenerationStub and worker_pb2.KVChunk.DESCRIPTOR.full_name == "pdserve.v1.KVChunk"

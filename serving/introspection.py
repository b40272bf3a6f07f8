"""What a gRPC server tells about itself: server reflection and health, for every pdserve server.

Reflection is served under both names clients ask for: `grpc.reflection.v1` (current grpcurl,
Postman, grpcui ask it first) and `grpc.reflection.v1alpha` (older clients, and
grpcio-reflection's own `ProtoReflectionDescriptorDatabase`). grpcio-reflection ships only
v1alpha; v1 has the same messages under another package, so one servicer answers both, and the
v1 file descriptor (v1alpha's, renamed) joins the pool so that v1 resolves like any service.

Health is grpcio-health-checking's servicer, except `List`: the generated base class raises
NotImplementedError there, which grpc logs with a traceback; here it answers UNIMPLEMENTED
without one, as a method the server does not have at all does.
"""
from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha import _async as reflection_aio

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
REFLECTION_SERVICES = (V1_SERVICE, V1ALPHA_SERVICE)
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class HealthServicer(health.aio.HealthServicer):
    async def List(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Health.List is not implemented; use Check or Watch")


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Serve reflection, v1 and v1alpha, listing `service_names` (the reflection services too)."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection_aio.ReflectionServicer([*service_names, *REFLECTION_SERVICES])
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method})
                                     for name in REFLECTION_SERVICES])


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """`grpc/reflection/v1/reflection.proto` in `pool`: v1alpha's file, renamed (once per process)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = f".{V1_PACKAGE}.{f.type_name[len(old):]}"
    for service in proto.service:
        for m in service.method:
            m.input_type = f".{V1_PACKAGE}.{m.input_type[len(old):]}"
            m.output_type = f".{V1_PACKAGE}.{m.output_type[len(old):]}"
    pool.AddSerializedFile(proto.SerializeToString())

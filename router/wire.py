"""Reading a public request's bytes ourselves, so that a malformed one is INVALID_ARGUMENT
naming what is wrong, never an exception inside gRPC's deserializer (UNKNOWN, a traceback).

Protobuf's own error says only that some string had bad UTF-8, or that the wire format was
corrupt. To name the field, the bytes are parsed again as a twin message whose strings are
`bytes` (built once from the real descriptor), and the fields holding invalid UTF-8 are found.
"""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

MAX_REQUEST_BYTES = 16 << 20  # a larger request is refused (and counted), not parsed


class BadRequest(ValueError):
    pass


def parse(cls: type[Message], raw: bytes) -> Message:
    """`cls` from `raw`; BadRequest naming the problem."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise BadRequest(f"request is {len(raw)} bytes; the limit is {MAX_REQUEST_BYTES}")
    try:
        return cls.FromString(raw)
    except DecodeError:
        pass
    try:
        twin = _twin(cls).FromString(raw)
    except DecodeError:
        raise BadRequest(f"request is not a valid {cls.DESCRIPTOR.full_name}: corrupt wire format") from None
    bad = _bad_utf8(twin, cls.DESCRIPTOR, "")
    raise BadRequest(f"{bad[0] if bad else 'a string field'} is not valid UTF-8")


_TWINS: dict[str, type[Message]] = {}


def _twin(cls: type[Message]) -> type[Message]:
    """The message class with every string field (nested ones too) read as bytes."""
    name = cls.DESCRIPTOR.full_name
    if name not in _TWINS:
        fd = descriptor_pb2.FileDescriptorProto()
        cls.DESCRIPTOR.file.CopyToProto(fd)
        fd.name = f"twin/{fd.name}"
        fd.ClearField("dependency")
        for msg in fd.message_type:
            for f in msg.field:
                if f.type == FieldDescriptor.TYPE_STRING:
                    f.type = FieldDescriptor.TYPE_BYTES
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fd)
        _TWINS[name] = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
    return _TWINS[name]


def _bad_utf8(msg: Message, desc, prefix: str) -> list[str]:
    """Names of the fields whose bytes are not UTF-8 (`prompt`, `sampling_params.stop[1]`)."""
    bad = []
    for field, value in msg.ListFields():
        real = desc.fields_by_name[field.name]
        name = prefix + field.name
        repeated = field.is_repeated
        values = value if repeated else [value]
        for i, v in enumerate(values):
            where = f"{name}[{i}]" if repeated else name
            if real.type == FieldDescriptor.TYPE_STRING and not _is_utf8(v):
                bad.append(where)
            elif real.type == FieldDescriptor.TYPE_MESSAGE:
                bad.extend(_bad_utf8(v, real.message_type, where + "."))
    return bad


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False

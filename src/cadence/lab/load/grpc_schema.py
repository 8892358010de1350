"""The message types of any gRPC method, from the server's reflection service or from .proto files.

`cadence bench --protocol grpc` drives a service cadence did not write, so it has no generated
stubs. It resolves the method once per run, in the parent process, into a `MethodSchema`: the
method's shape and a serialized `FileDescriptorSet` holding its file and every file that one
imports. Each load process rebuilds the two message classes from those bytes in a pool of its
own (`message_classes`), so a service whose package clashes with cadence's own protos still
loads, and nothing is compiled twice.

Reflection: `grpc.reflection.v1` first, then `grpc.reflection.v1alpha` (the two differ only in
their package name, so one set of message classes reads both). Protos: compiled by protoc from
grpcio-tools with `--include_imports`, the well-known types found on protoc's own include path.
Every failure is a `SchemaError` whose text says what to fix, in one line.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence

import grpc
import msgspec
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message


class SchemaError(Exception):
    """The method cannot be resolved; the message says why and what to do."""


class MethodSchema(msgspec.Struct, frozen=True, kw_only=True):
    """One method's shape and the descriptors of its types (what every load process needs)."""

    service: str
    """Full name, `package.Service`."""
    method: str
    request_type: str
    """Full names of the message types."""
    response_type: str
    client_streaming: bool
    server_streaming: bool
    files: bytes
    """A serialized FileDescriptorSet: the method's file and everything it imports."""
    source: str
    """Where the types came from: "reflection v1", "reflection v1alpha" or "protos"."""

    @property
    def path(self) -> str:
        """The method's HTTP/2 path, `/package.Service/Method`."""
        return f"/{self.service}/{self.method}"


def split_method(text: str) -> tuple[str, str]:
    """`package.Service/Method` (a leading `/` and a `.` before the method are accepted)."""
    text = text.strip().lstrip("/")
    service, sep, method = text.rpartition("/")
    if not sep:
        service, sep, method = text.rpartition(".")
    if not service or not method:
        raise SchemaError(f"--method: expected PACKAGE.SERVICE/METHOD, got {text!r}")
    return service, method


_REFLECTION = ("grpc.reflection.v1", "grpc.reflection.v1alpha")


def from_reflection(
    channel: grpc.Channel,
    method: str,
    timeout: float = 10.0,
    metadata: Sequence[tuple[str, str]] = (),
) -> MethodSchema:
    """Ask the server's reflection service for `method`'s file and its imports."""
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    service, name = split_method(method)
    for package in _REFLECTION:
        info = channel.stream_stream(
            f"/{package}.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )

        def ask(info=info, **request) -> rpb.ServerReflectionResponse:
            (reply,) = info(
                iter((rpb.ServerReflectionRequest(**request),)), timeout=timeout, metadata=metadata
            )
            return reply

        try:
            reply = ask(file_containing_symbol=service)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                continue  # this version of reflection is not served: try the next
            raise SchemaError(_rpc_failure(exc, "asking its reflection service")) from None
        if reply.HasField("error_response"):
            offered = _services(ask(list_services=""))
            raise SchemaError(
                f"the server has no service {service!r} (it offers: {', '.join(offered) or 'none'})"
            )
        files = _with_imports(
            reply.file_descriptor_response.file_descriptor_proto,
            lambda filename: ask(file_by_filename=filename),
        )
        return _schema(files, service, name, f"reflection {package.rsplit('.', 1)[1]}")
    raise SchemaError(
        "the server offers no reflection service (grpc.reflection.v1 or v1alpha): "
        "give its protos with --proto FILE (and --proto-path DIR)"
    )


def _services(reply) -> list[str]:
    return sorted(
        s.name
        for s in reply.list_services_response.service
        if not s.name.startswith(("grpc.reflection.", "grpc.health."))
    )


def _with_imports(first: Iterable[bytes], fetch) -> list[descriptor_pb2.FileDescriptorProto]:
    """The files reflection returned plus, fetched by name, every import they still miss."""
    files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    todo = list(first)
    while todo:
        proto = descriptor_pb2.FileDescriptorProto.FromString(todo.pop())
        if proto.name in files:
            continue
        files[proto.name] = proto
        for dependency in proto.dependency:
            if dependency in files or _well_known(dependency) is not None:
                continue
            reply = fetch(dependency)
            if reply.HasField("error_response"):
                raise SchemaError(
                    f"the server's reflection does not return {dependency!r}, which "
                    f"{proto.name!r} imports: give the protos with --proto"
                )
            todo.extend(reply.file_descriptor_response.file_descriptor_proto)
    return list(files.values())


def from_protos(protos: Sequence[str], proto_paths: Sequence[str], method: str) -> MethodSchema:
    """Compile `protos` with protoc. Each is a path relative to one of `proto_paths` (default:
    the current folder), or a file of its own, whose folder then joins the include paths."""
    from grpc_tools import protoc

    service, name = split_method(method)
    include = [os.path.join(os.path.dirname(protoc.__file__), "_proto")]
    paths = list(proto_paths) or ["."]
    names = []
    for proto in protos:
        found = _relative(proto, paths)
        if found is None and os.path.isfile(proto):
            paths.append(os.path.dirname(os.path.abspath(proto)))
            found = os.path.basename(proto)
        names.append(found or proto)  # not found: protoc says so
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "set.pb")
        args = [
            "protoc",
            f"--descriptor_set_out={out}",
            "--include_imports",
            *(f"--proto_path={p}" for p in [*paths, *include]),
            *names,
        ]
        if protoc.main(args) != 0:
            raise SchemaError("--proto: protoc could not compile the files (its message is above)")
        with open(out, "rb") as f:
            found_set = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    return _schema(list(found_set.file), service, name, "protos")


def _relative(proto: str, paths: list[str]) -> str | None:
    """`proto` as protoc names it: relative to the include path that holds it, or None."""
    for p in paths:
        if not os.path.isabs(proto) and os.path.isfile(os.path.join(p, proto)):
            return proto
        root, full = os.path.abspath(p), os.path.abspath(proto)
        if full.startswith(root + os.sep) and os.path.isfile(full):
            return os.path.relpath(full, root)
    return None


def _schema(
    files: list[descriptor_pb2.FileDescriptorProto], service: str, method: str, source: str
) -> MethodSchema:
    found = None
    services = []
    for proto in files:
        for s in proto.service:
            full = f"{proto.package}.{s.name}" if proto.package else s.name
            services.append(full)
            if full == service:
                found = s
    if found is None:
        raise SchemaError(
            f"no service {service!r} in the {source} (found: "
            f"{', '.join(sorted(services)) or 'none'})"
        )
    for m in found.method:
        if m.name == method:
            break
    else:
        raise SchemaError(
            f"service {service!r} has no method {method!r} (it has: "
            f"{', '.join(m.name for m in found.method)})"
        )
    if not m.server_streaming:
        raise SchemaError(
            f"{service}/{method} does not stream its response: cadence bench "
            "measures server-streaming and bidirectional methods"
        )
    schema = MethodSchema(
        service=service,
        method=method,
        request_type=m.input_type.lstrip("."),
        response_type=m.output_type.lstrip("."),
        client_streaming=m.client_streaming,
        server_streaming=m.server_streaming,
        files=descriptor_pb2.FileDescriptorSet(file=files).SerializeToString(),
        source=source,
    )
    message_classes(schema)  # fails here, in the parent, if the files do not build
    return schema


def message_classes(schema: MethodSchema) -> tuple[type[Message], type[Message]]:
    """The request and response message classes, built in a pool of their own."""
    pool = descriptor_pool.DescriptorPool()
    files = {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(schema.files).file}
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        proto = files.get(name) or _well_known(name)
        if proto is None:
            raise SchemaError(f"the descriptors miss {name!r}, an import of the method's file")
        added.add(name)
        for dependency in proto.dependency:
            add(dependency)
        pool.Add(proto)

    try:
        for name in files:
            add(name)
        return tuple(
            message_factory.GetMessageClass(pool.FindMessageTypeByName(t))
            for t in (schema.request_type, schema.response_type)
        )
    except (TypeError, KeyError) as exc:
        raise SchemaError(f"the method's descriptors do not build: {exc}") from None


def _well_known(name: str) -> descriptor_pb2.FileDescriptorProto | None:
    """google/protobuf/*.proto, which servers may leave out of reflection replies."""
    if not name.startswith("google/protobuf/"):
        return None
    from google.protobuf import (  # noqa: F401  (registers the well-known files)
        any_pb2,
        duration_pb2,
        empty_pb2,
        field_mask_pb2,
        struct_pb2,
        timestamp_pb2,
        wrappers_pb2,
    )

    try:
        found = descriptor_pool.Default().FindFileByName(name)
    except KeyError:
        return None
    proto = descriptor_pb2.FileDescriptorProto()
    found.CopyToProto(proto)
    return proto


def _rpc_failure(exc: grpc.RpcError, doing: str) -> str:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"the server is unavailable while {doing}: {exc.details()}"
    return f"{code.name} while {doing}: {exc.details()}"

"""The load generator's third protocol: one request to any gRPC streaming method.

`cadence bench --protocol grpc --method PACKAGE.SERVICE/METHOD --request-json JSON` drives a
service cadence did not write. The request is the proto3 JSON mapping of the method's input
type, with whole string values `"{max_tokens}"`, `"{prompt}"`, `"{request_id}"` and `"{i}"`
replaced per request (`RequestTemplate`). A server-streaming method gets the request and reads
to the end; a bidirectional one gets the request, a half-close, and is read to the end.

Between two arrivals the generator only stamps the time and keeps the message's bytes, as on
the cadence path; `GrpcCodec.decode` parses them after the run. A service's messages can be
far larger than cadence's, so a load process keeps at most UNPARSED_BYTES of them: past that,
each message is parsed as it arrives and only what the analysis reads of it is kept (its
token count and position; the time is stamped either way). What a message counts:
`--tokens-field` names a field of the response (a repeated field counts its elements, a
number is read as a count, a non-empty string or bytes counts one); without it every message
is one token. `--index-field` names the field that numbers the output (the position of the
message's first token, or the message's number without `--tokens-field`): with it the
integrity checks (lost, repeated, reordered) hold; without it the positions are counted on
the client and those checks cannot fail. The protocol has no finish reason: a stream that
ends OK counts as finished, so a service that stops early is not a "short stream".
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import grpc
import msgspec
from google.protobuf import descriptor, json_format
from google.protobuf.message import Message

from cadence.lab.load.driver import ChannelDriver
from cadence.lab.load.grpc_schema import MethodSchema, SchemaError, message_classes
from cadence.lab.load.recording import recording, sent, traceparent
from cadence.lab.records import RequestRecord
from cadence.lab.results import GrpcWorkload

if TYPE_CHECKING:
    from cadence.lab.load.plan import RequestPlan
    from cadence.lab.results import Workload

PLACEHOLDERS = ("{max_tokens}", "{prompt}", "{request_id}", "{i}")

_STOPPED = 2
"""The finish reason recorded for a stream that ended OK (cadence.v1's STOP)."""

UNPARSED_BYTES = 32 * 2**20
"""Message bytes a load process keeps unparsed until the run ends. Parsing as messages
arrive costs a load process about a fifth more CPU per message (cadence_v1), which a run of
small messages need not pay; a run of large ones (a service sending a megabyte a message)
would otherwise hold every byte it received until the end."""


class GrpcTarget(msgspec.Struct, frozen=True, kw_only=True, tag="grpc"):
    """Which method to drive, with what request, and how to read its responses."""

    schema: MethodSchema
    request_json: str
    tokens_field: str = ""
    index_field: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    """Metadata sent with every call (keys lower-case, as gRPC requires)."""

    CADENCE_SERVER: ClassVar[bool] = False
    HTTP2_SETTINGS: ClassVar[bool] = True
    SERVER_TIMING: ClassVar[bool] = False

    def driver(self) -> GrpcDriver:
        return GrpcDriver(GrpcCodec(self))

    def address(self, target: str) -> str:
        return target

    def describe(self, workload: Workload) -> None:
        workload.grpc = GrpcWorkload(
            method=self.schema.path,
            types_from=self.schema.source,
            bidirectional=self.schema.client_streaming,
            request_json=self.request_json,
            tokens_field=self.tokens_field or None,
            index_field=self.index_field or None,
            headers=sorted({k for k, _ in self.headers}),
        )


def parse_header(text: str) -> tuple[str, str]:
    """`KEY=VALUE` (or `KEY: VALUE`) → (key in lower case, value); raise ValueError."""
    key, sep, value = text.partition("=")
    if not sep:
        key, sep, value = text.partition(":")
    key = key.strip().lower()
    if not sep or not key:
        raise ValueError(f"--header: expected KEY=VALUE, got {text!r}")
    return key, value.strip()


class RequestTemplate:
    """The request JSON with its placeholders; `message(plan)` is one request.

    Placeholders in singular string and integer fields (nested messages included) are set on a
    copy of the request parsed once, which costs microseconds: a burst of requests is not
    held up by the client building them. Anywhere else (a list, a map, a bytes or enum field)
    the whole JSON is parsed again for each request.
    """

    def __init__(self, request_type: type[Message], text: str) -> None:
        try:
            self._doc = json.loads(text)
        except ValueError as exc:
            raise SchemaError(f"--request-json is not JSON: {exc}") from None
        if not isinstance(self._doc, dict):
            raise SchemaError("--request-json must be a JSON object (the request message)")
        self._type = request_type
        self._slots: list[tuple[list, str]] = []
        """(path to a value, its placeholder) for every whole-string placeholder."""
        self._find(self._doc, [])
        self._fields = self._fields_of_slots()
        """Per slot, (field names along its path, the leaf's type); None: parse every time."""
        if self._fields is not None:
            fixed = json.loads(json.dumps(self._doc))
            for path, _ in self._slots:
                node = fixed
                for key in path[:-1]:
                    node = node[key]
                del node[path[-1]]
            self._prototype = self._parse(fixed)

    def _find(self, node, path: list) -> None:
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, value in items:
            if isinstance(value, str) and value in PLACEHOLDERS:
                self._slots.append(([*path, key], value))
            else:
                self._find(value, [*path, key])

    def _fields_of_slots(self) -> list[tuple[list[str], type]] | None:
        found: list[tuple[list[str], type]] = []
        for path, _ in self._slots:
            names, current, field = [], self._type.DESCRIPTOR, None
            for key in path:
                if not isinstance(key, str) or current is None:
                    return None
                field = current.fields_by_name.get(key) or next(
                    (f for f in current.fields if f.json_name == key), None
                )
                if field is None or field.is_repeated:
                    return None
                names.append(field.name)
                current = field.message_type if field.type == field.TYPE_MESSAGE else None
            assert field is not None  # a slot's path has at least one key (`_find`)
            if field.type == field.TYPE_STRING:
                found.append((names, str))
            elif field.cpp_type in _INTEGER_CPP_TYPES:
                found.append((names, int))
            else:
                return None
        return found

    def _parse(self, doc):
        try:
            return json_format.ParseDict(doc, self._type())
        except json_format.ParseError as exc:
            raise SchemaError(f"--request-json: {' '.join(str(exc).split())}") from None

    def message(self, plan: RequestPlan):
        """The request message of `plan`; SchemaError names a field the type lacks."""
        values = {
            "{max_tokens}": str(plan.max_tokens),
            "{request_id}": plan.request_id,
            "{i}": str(plan.number),
            "{prompt}": bytes(plan.prompt_token_ids).decode("utf-8", errors="replace"),
        }
        if self._fields is None:
            doc = json.loads(json.dumps(self._doc))
            for path, placeholder in self._slots:
                node = doc
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = values[placeholder]
            return self._parse(doc)
        message = self._type()
        message.CopyFrom(self._prototype)
        for (_, placeholder), (names, kind) in zip(self._slots, self._fields, strict=True):
            node = message
            for name in names[:-1]:
                node = getattr(node, name)
            try:
                setattr(node, names[-1], kind(values[placeholder]))
            except ValueError as exc:
                raise SchemaError(
                    f"--request-json: {'.'.join(names)} cannot hold {placeholder} ({exc})"
                ) from None
        return message


_INTEGER_CPP_TYPES = frozenset(
    (
        descriptor.FieldDescriptor.CPPTYPE_INT32,
        descriptor.FieldDescriptor.CPPTYPE_INT64,
        descriptor.FieldDescriptor.CPPTYPE_UINT32,
        descriptor.FieldDescriptor.CPPTYPE_UINT64,
    )
)


def _field(message_type: descriptor.Descriptor, path: str, option: str) -> list:
    """The field descriptors along a dotted `path` of `message_type`."""
    fields = []
    current = message_type
    for part in path.split("."):
        if current is None or part not in current.fields_by_name:
            names = ", ".join(current.fields_by_name) if current is not None else "none"
            raise SchemaError(
                f"{option}: {message_type.full_name} has no field {path!r} (its fields: {names})"
            )
        field = current.fields_by_name[part]
        fields.append(field)
        current = field.message_type if field.type == field.TYPE_MESSAGE else None
    return fields


def _counter(fields: list, option: str) -> Callable[[object], int]:
    """Reads the number a message's field stands for (see the module's docstring)."""
    *outer, last = fields
    if any(f.is_repeated for f in outer):
        raise SchemaError(f"{option}: the path crosses a repeated field")
    names = [f.name for f in fields]

    def leaf(message):
        for name in names[:-1]:
            message = getattr(message, name)
        return getattr(message, names[-1])

    if last.is_repeated:
        return lambda m: len(leaf(m))
    if last.type in (last.TYPE_STRING, last.TYPE_BYTES):
        return lambda m: 1 if leaf(m) else 0
    if last.type in (last.TYPE_MESSAGE, last.TYPE_BOOL, last.TYPE_FLOAT, last.TYPE_DOUBLE):
        raise SchemaError(f"{option}: {'.'.join(names)} is not a count, a list or a string")
    return lambda m: int(leaf(m))


class GrpcCodec:
    """One load process's view of a `GrpcTarget`: message classes, template, readers."""

    def __init__(self, target: GrpcTarget) -> None:
        self.target = target
        request_type, response_type = message_classes(target.schema)
        self.response_type = response_type
        self.template = RequestTemplate(request_type, target.request_json)
        out = response_type.DESCRIPTOR
        self._tokens = (
            _counter(_field(out, target.tokens_field, "--tokens-field"), "--tokens-field")
            if target.tokens_field
            else None
        )
        self._index: Callable[[object], int] | None
        if target.index_field:
            index = _field(out, target.index_field, "--index-field")
            if index[-1].is_repeated or index[-1].type in (
                index[-1].TYPE_STRING,
                index[-1].TYPE_BYTES,
                index[-1].TYPE_MESSAGE,
            ):
                raise SchemaError(f"--index-field: {target.index_field} is not an integer")
            self._index = _counter(index, "--index-field")
        else:
            self._index = None
        self.metadata = target.headers or None
        self._made: dict[str, bytes] = {}
        self.unparsed = 0
        """Bytes of the messages kept unparsed so far (`one_grpc`)."""
        self.unparsed_limit = UNPARSED_BYTES

    def prepare(self, plans) -> None:
        """Serialize these requests now, ahead of a burst that sends them at once."""
        self._made.update((p.request_id, self.request(p)) for p in plans)

    def request(self, plan: RequestPlan) -> bytes:
        """The serialized request of `plan` (made ahead by `prepare`, or now)."""
        made = self._made.pop(plan.request_id, None)
        return made if made is not None else self.template.message(plan).SerializeToString()

    def method(self, channel: grpc.aio.Channel) -> Callable:
        """The method on `channel`, sending and answering bytes (nothing parsed per message)."""
        path = self.target.schema.path
        if self.target.schema.client_streaming:
            call = channel.stream_stream(path)
            return lambda request, **kw: call(iter((request,)), **kw)
        return channel.unary_stream(path)

    def decode(self, record: RequestRecord, messages: Sequence[bytes]) -> None:
        """Fill the record's per-message token counts and positions, in arrival order, after
        those it already has."""
        parse, count, number = self.response_type.FromString, self._tokens, self._index
        tokens, index = record.tokens, record.index
        # Without --index-field the position is counted here: it goes on from the last.
        position = index[-1] + tokens[-1] if tokens and number is None else 0
        for data in messages:
            message = parse(data)
            n = count(message) if count is not None else 1
            index.append(number(message) if number is not None else position)
            tokens.append(n)
            position += n


async def one_grpc(
    codec: GrpcCodec,
    method: Callable,
    plan: RequestPlan,
    process: int,
    include_timing: bool,
    timeout: float | None,
    read_delay_s: float = 0.0,
    stall_s: float | None = None,
) -> tuple[RequestRecord, list[bytes]]:
    """Send one request, stamp and keep every response (its bytes, or what is read of it,
    see UNPARSED_BYTES); never raises (errors are recorded; `stall_s`: see `recording`).

    The load generator's signature: `include_timing` is accepted (no such thing here)."""
    request = codec.request(plan)
    monotonic_ns = time.monotonic_ns
    record = sent(plan, process)
    arrival = record.arrival_ns
    messages: list[bytes] = []
    keep = messages.append
    parsing = False
    """Whether this request's messages are parsed as they come (the process's unparsed
    bytes ran out): then every later one is, so that its counts stay in arrival order."""
    with recording(record, stall_s, plan.cancel_s):
        metadata = (*(codec.metadata or ()), ("traceparent", traceparent(record)), *plan.headers)
        async for message in method(request, timeout=timeout, metadata=metadata):
            arrival.append(monotonic_ns())
            if not parsing and codec.unparsed + len(message) <= codec.unparsed_limit:
                codec.unparsed += len(message)
                keep(message)
            else:
                if not parsing:
                    parsing = True
                    codec.decode(record, messages)
                    codec.unparsed -= sum(map(len, messages))
                    messages.clear()
                codec.decode(record, (message,))
            if read_delay_s:
                await asyncio.sleep(read_delay_s)
        record.finish_reason = _STOPPED
    return record, messages


class GrpcDriver(ChannelDriver):
    def __init__(self, codec: GrpcCodec) -> None:
        self.codec = codec

    def stub(self, channel: grpc.aio.Channel) -> Callable:
        return self.codec.method(channel)

    def prepare(self, requests) -> None:
        self.codec.prepare(requests)

    async def one(
        self, request: RequestPlan, process: int, lane: int
    ) -> tuple[RequestRecord, list[bytes]]:
        s = self.session
        return await one_grpc(
            self.codec,
            self.stubs[lane % len(self.stubs)],
            request,
            process,
            s.include_timing,
            *s.for_request(request),
            s.stall_s,
        )

    def decode(self, record: RequestRecord, chunks: list[bytes]) -> None:
        self.codec.decode(record, chunks)


def check_request(target: GrpcTarget, sample: RequestPlan) -> None:
    """Build every reader and one request before any process starts: a wrong field name or
    value is one SchemaError here, not an error per request."""
    GrpcCodec(target).template.message(sample)


def headers_of(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple(parse_header(h) for h in items)

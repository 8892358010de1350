"""The load generator's second protocol: one request through the Open Inference Protocol.

`cadence bench --protocol kserve --model NAME` sends each request as a `ModelStreamInfer`
call (KServe v2 over gRPC with Triton's streaming extension) to any server of that
protocol: cadence, Triton, PyTriton. One call per request, like `Generate`: the request is
sent, the call half-closed, and every response read until the one that carries
`triton_final_response` (the request asks for an empty final response, so servers whose
model sends the final flag alone still mark the end).

What is recorded, per response: its arrival time and its token count, the elements of its
`TOKEN_IDS` output, or 1 for a response with outputs but no `TOKEN_IDS` (a model that sends
one token per response under another name), or its `outputs` parameter where cadence sends
one (a batched model's text pieces, one position each whatever their token ids). A response without outputs (the final flag
alone) counts 0 tokens. `index` is the count of tokens received before the response: the
protocol has no position field, so lost tokens show only as a short stream (fewer than
max_tokens tokens at the final flag), and reordering cannot be seen. No server timing exists
in this protocol, so no segments are reported. In-band errors are recorded under the gRPC
code name their message starts with (cadence's convention), else as INFERENCE_ERROR.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, ClassVar

import grpc
import msgspec

from cadence.lab.load.driver import ChannelDriver
from cadence.lab.load.recording import recording, sent, traceparent
from cadence.lab.records import RequestRecord
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.kserve import grpc_service_pb2_grpc as kpb_grpc
from cadence.proto.kserve.tensors import int32_raw

if TYPE_CHECKING:
    from cadence.lab.load.plan import RequestPlan
    from cadence.lab.results import Workload

PROMPT, MAX_TOKENS = "prompt", "max_tokens"
"""Sources of an input's value: the request's prompt token ids, or its max_tokens."""
BATCHED = ":batched"
"""A source's suffix: the input gets a leading batch dimension of one (shape [1, n]), as a
Triton model with batching (max_batch_size > 0, PyTriton's @batch) wants."""

DEFAULT_INPUTS = (("PROMPT_TOKEN_IDS", PROMPT), ("MAX_TOKENS", MAX_TOKENS))
"""cadence's own model's inputs (docs/kserve.md)."""

_FINISH_REASONS = {"length": 1, "stop": 2, "cancelled": 3}
_CODE_NAMES = frozenset(code.name for code in grpc.StatusCode)


class KServeTarget(msgspec.Struct, frozen=True, tag="kserve"):
    """Which model to drive and how a request's fields become its INT32 inputs."""

    model: str
    inputs: tuple[tuple[str, str], ...] = DEFAULT_INPUTS
    """(input name, source): `prompt` (the prompt token ids, shape [n]), `max_tokens`
    (shape [1]), or an integer constant (shape [1]); with BATCHED after it, shape [1, n]."""

    CADENCE_SERVER: ClassVar[bool] = True
    """As cadence's `--kserve` front: its metrics and workers are looked up (another server
    simply has none)."""
    HTTP2_SETTINGS: ClassVar[bool] = True
    SERVER_TIMING: ClassVar[bool] = False

    def driver(self) -> KServeDriver:
        return KServeDriver(self)

    def address(self, target: str) -> str:
        return target

    def describe(self, workload: Workload) -> None:
        workload.model = self.model


class KServeDriver(ChannelDriver):
    def __init__(self, target: KServeTarget) -> None:
        self.target = target

    def stub(self, channel: grpc.aio.Channel) -> kpb_grpc.GRPCInferenceServiceStub:
        return stub(channel)

    async def one(
        self, request: RequestPlan, process: int, lane: int
    ) -> tuple[RequestRecord, list[bytes]]:
        s = self.session
        return await one_kserve(
            self.target,
            self.stubs[lane % len(self.stubs)],
            request,
            process,
            s.include_timing,
            *s.for_request(request),
            s.stall_s,
        )

    def decode(self, record: RequestRecord, chunks: list[bytes]) -> None:
        """Nothing left: each response was read as it arrived."""


def parse_inputs(text: str) -> tuple[tuple[str, str], ...]:
    """`NAME=SOURCE,...` (SOURCE: prompt, max_tokens or an integer, each optionally followed by
    `:batched`); raise ValueError."""
    inputs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, source = item.partition("=")
        if not sep or not name:
            raise ValueError(f"expected NAME=SOURCE, got {item!r}")
        value = source.removesuffix(BATCHED)
        if value not in (PROMPT, MAX_TOKENS):
            try:
                int(value)
            except ValueError:
                raise ValueError(
                    f"the source of {name} must be prompt, max_tokens or an "
                    f"integer (then optionally {BATCHED}), got {source!r}"
                ) from None
        inputs.append((name, source))
    if not inputs:
        raise ValueError("give at least one input")
    return tuple(inputs)


def stub(channel: grpc.aio.Channel) -> kpb_grpc.GRPCInferenceServiceStub:
    return kpb_grpc.GRPCInferenceServiceStub(channel)


def build_request(target: KServeTarget, plan: RequestPlan) -> kpb.ModelInferRequest:
    """The ModelInferRequest of one planned request."""
    request = kpb.ModelInferRequest(model_name=target.model, id=plan.request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, source in target.inputs:
        value = source.removesuffix(BATCHED)
        values = (
            plan.prompt_token_ids
            if value == PROMPT
            else [plan.max_tokens]
            if value == MAX_TOKENS
            else [int(value)]
        )
        shape = (len(values),) if value == source else (1, len(values))
        request.inputs.add(name=name, datatype="INT32", shape=shape)
        request.raw_input_contents.append(int32_raw(values))
    return request


async def one_kserve(
    target: KServeTarget,
    stub: kpb_grpc.GRPCInferenceServiceStub,
    plan: RequestPlan,
    process: int,
    include_timing: bool,
    timeout: float | None,
    read_delay_s: float = 0.0,
    stall_s: float | None = None,
) -> tuple[RequestRecord, list[bytes]]:
    """Send one request, record every response; never raises (errors are recorded).

    The load generator's signature: `include_timing` is accepted (the protocol has none), and
    the record comes with no chunks left to parse (each response is read as it arrives)."""
    request = build_request(target, plan)
    monotonic_ns = time.monotonic_ns
    record = sent(plan, process)
    arrival, tokens, index = record.arrival_ns, record.tokens, record.index
    received = 0
    # The request and then the half-close: the server ends the call after the last response.
    call = stub.ModelStreamInfer(
        iter((request,)),
        timeout=timeout,
        metadata=(("traceparent", traceparent(record)), *plan.headers),
    )
    with recording(record, stall_s, plan.cancel_s):
        async for response in call:
            now = monotonic_ns()
            if response.error_message:
                code, _, _ = response.error_message.partition(":")
                record.code = code if code in _CODE_NAMES else "INFERENCE_ERROR"
                record.error = response.error_message
                continue
            infer = response.infer_response
            count = _tokens_in(infer)
            arrival.append(now)
            tokens.append(count)
            index.append(received)
            received += count
            final = infer.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                reason = infer.parameters.get("finish_reason")
                record.finish_reason = _FINISH_REASONS.get(reason.string_param, 1) if reason else 1
                cached = infer.parameters.get("cached_tokens")
                if cached is not None:
                    record.cached_tokens = cached.int64_param
            elif read_delay_s:
                await asyncio.sleep(read_delay_s)
    return record, []


def _tokens_in(infer: kpb.ModelInferResponse) -> int:
    outputs = infer.parameters.get("outputs")  # a model's text pieces: one position each
    if outputs is not None:
        return outputs.int64_param
    for output in infer.outputs:
        if output.name == "TOKEN_IDS":
            return math.prod(output.shape)
    return 1 if infer.outputs else 0

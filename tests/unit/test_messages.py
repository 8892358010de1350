"""Every cross-process message survives msgpack through its tagged union."""

from __future__ import annotations

import msgspec
import pytest

from cadence.config import EngineConfig, WorkerSpec
from cadence.transport.messages import (
    RequestFailed,
    Shutdown,
    StepOutput,
    WorkerInput,
    WorkerInputs,
    WorkerOutput,
    WorkerReady,
)
from cadence.vocabulary import GREEDY, AddRequest, Failure, Finish, Sampling

encode = msgspec.msgpack.Encoder().encode
decode_input = msgspec.msgpack.Decoder(WorkerInput).decode
decode_output = msgspec.msgpack.Decoder(WorkerOutput).decode


def test_worker_inputs_roundtrip():
    msg = WorkerInputs(
        adds=[
            AddRequest(1, [72, 105], 16),
            AddRequest(2, [0, 255], 3, Sampling(0.7, 0.9, 40, 2**63 - 1, (10, 46))),
        ],
        aborts=[5, 6],
    )
    got = decode_input(encode(msg))
    assert type(got) is WorkerInputs
    assert got == msg
    assert got.adds[0].sampling == GREEDY and got.adds[0].sampling.stop_token_ids == ()
    assert got.adds[1].sampling.seed == 2**63 - 1


def test_sampling_costs_a_greedy_request_one_byte():
    """The sampling struct crosses to the worker without its defaults: a greedy request's
    is one byte, and each field set adds only itself."""
    assert encode(GREEDY) == b"\x80"
    greedy = len(encode(AddRequest(1, [72], 16)))
    sampled = len(encode(AddRequest(1, [72], 16, Sampling(temperature=0.5))))
    assert sampled - greedy == len(encode({"t": 0.5})) - 1
    stops = AddRequest(1, [72], 16, Sampling(stop_token_ids=(3, 4)))
    assert decode_input(encode(WorkerInputs([stops], []))).adds == [stops]


def test_empty_worker_inputs_roundtrip():
    msg = WorkerInputs([], [])
    assert decode_input(encode(msg)) == msg


def test_shutdown_roundtrip():
    assert type(decode_input(encode(Shutdown()))) is Shutdown


def test_step_output_roundtrip():
    msg = StepOutput(
        worker=3,
        step=42,
        start_ns=1_700_000_000_000_000_000,
        end_ns=1_700_000_000_020_000_000,
        seq_ids=[1, 2, 3],
        token_ids=[65, 66, 67],
        finished_ids=[2],
        finish_reasons=[Finish.STOP],
    )
    got = decode_output(encode(msg))
    assert type(got) is StepOutput
    assert got == msg
    assert Finish(got.finish_reasons[0]) is Finish.STOP


def test_request_failed_roundtrip():
    msg = RequestFailed(
        9, Failure.INVALID_ARGUMENT, "prompt_token_ids must be in [0, 256); got 300"
    )
    got = decode_output(encode(msg))
    assert type(got) is RequestFailed
    assert got == msg


def test_worker_ready_roundtrip():
    msg = WorkerReady(0, 1234, "synthetic")
    got = decode_output(encode(msg))
    assert type(got) is WorkerReady
    assert got == msg


def test_tags_distinguish_union_members():
    # array_like structs carry no field names; the tag alone picks the type.
    outputs = [
        WorkerReady(1, 2, "x"),
        RequestFailed(1, Failure.CANCELLED, "x"),
        StepOutput(0, 1, 2, 3, [], [], [], []),
    ]
    kinds = [type(decode_output(encode(m))) for m in outputs]
    assert kinds == [WorkerReady, RequestFailed, StepOutput]


def test_output_is_not_an_input():
    with pytest.raises(msgspec.ValidationError):
        decode_input(encode(StepOutput(0, 1, 2, 3, [], [], [], [])))
    with pytest.raises(msgspec.ValidationError):
        decode_output(encode(WorkerInputs([], [])))


def test_worker_spec_json_roundtrip():
    spec = WorkerSpec(
        index=1,
        device="cuda:1",
        input_address="ipc:///tmp/x/in-1",
        output_address="ipc:///tmp/x/out",
        engine=EngineConfig(step_ms=5.0, seed=3, max_batch=8),
    )
    assert msgspec.json.decode(msgspec.json.encode(spec), type=WorkerSpec) == spec

"""The Open Inference Protocol's tensors and cadence's model: requests in, messages out."""

from __future__ import annotations

import struct

import pytest

from cadence.api.kserve import model
from cadence.core.errors import InvalidRequest
from cadence.lab.load.kserve import KServeTarget, _tokens_in, build_request, parse_inputs
from cadence.lab.load.plan import RequestPlan
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.kserve.tensors import TensorError, bytes_raw, decode_input, int32_raw
from cadence.vocabulary import Sampling


def _request(*inputs: tuple[str, str, list[int], bytes], **fields) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="cadence", **fields)
    for name, datatype, shape, raw in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    return request


def test_raw_and_typed_contents_read_the_same() -> None:
    raw = kpb.ModelInferRequest.InferInputTensor(name="X", datatype="INT32", shape=[3])
    typed = kpb.ModelInferRequest.InferInputTensor(name="X", datatype="INT32", shape=[3])
    typed.contents.int_contents.extend([1, -2, 3])
    assert decode_input(raw, int32_raw([1, -2, 3])) == decode_input(typed, None) == [1, -2, 3]
    text = kpb.ModelInferRequest.InferInputTensor(name="T", datatype="BYTES", shape=[2])
    assert decode_input(text, bytes_raw(b"ab") + bytes_raw(b"")) == [b"ab", b""]
    fp = kpb.ModelInferRequest.InferInputTensor(name="F", datatype="FP32", shape=[1])
    assert decode_input(fp, struct.pack("<f", 0.5)) == [0.5]


@pytest.mark.parametrize(
    ("datatype", "shape", "raw", "needle"),
    [
        ("INT32", [2], int32_raw([1]), "carries 1"),
        ("INT32", [1], b"\x01\x02", "whole number"),
        ("INT32", [-1], b"", "negative dimension"),
        ("BYTES", [1], b"\x05\x00\x00\x00ab", "runs past"),
        ("BYTES", [1], b"\x05\x00", "inside an element's length"),
        ("FP16", [1], b"\x00\x00", "does not read"),
    ],
)
def test_malformed_tensors_are_refused(datatype, shape, raw, needle) -> None:
    tensor = kpb.ModelInferRequest.InferInputTensor(name="X", datatype=datatype, shape=shape)
    with pytest.raises(TensorError, match=needle):
        decode_input(tensor, raw)


def test_a_request_becomes_cadences_own() -> None:
    request = _request(
        ("PROMPT_TOKEN_IDS", "INT32", [3], int32_raw([7, 8, 9])),
        ("MAX_TOKENS", "UINT32", [1], struct.pack("<I", 12)),
        ("TEMPERATURE", "FP32", [1], struct.pack("<f", 0.5)),
        ("TOP_K", "INT64", [1], struct.pack("<q", 4)),
        ("SEED", "UINT64", [1], struct.pack("<Q", 2**40)),
        ("STOP_TOKEN_IDS", "INT32", [1], int32_raw([9])),
        id="r1",
    )
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    request.outputs.add(name="TEXT")
    translated = model.to_stream_request(request)
    g = translated.request
    assert (g.request_id, list(g.prompt_token_ids), g.max_tokens) == ("r1", [7, 8, 9], 12)
    assert g.sampling == Sampling(temperature=0.5, top_k=4, seed=2**40, stop_token_ids=(9,))
    assert translated.empty_final and translated.want_text and not translated.want_tokens
    text = model.to_stream_request(
        _request(
            ("PROMPT", "BYTES", [1], bytes_raw("héllo".encode())),
            ("MAX_TOKENS", "INT32", [1], int32_raw([3])),
        )
    )
    assert text.request.prompt == "héllo" and not text.empty_final
    assert text.want_tokens and text.want_text


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        (
            [
                ("MAX_TOKENS", "INT32", [1], int32_raw([3])),
                ("MAX_TOKENS", "INT32", [1], int32_raw([3])),
            ],
            "given twice",
        ),
        ([("COLOR", "INT32", [1], int32_raw([3]))], "unknown input 'COLOR'"),
        ([("MAX_TOKENS", "INT32", [2], int32_raw([3, 4]))], "takes one element"),
        ([("MAX_TOKENS", "INT32", [1], int32_raw([-1]))], "between 1 and"),
        ([("MAX_TOKENS", "BYTES", [1], bytes_raw(b"3"))], "expected INT32"),
        (
            [
                ("PROMPT", "BYTES", [1], bytes_raw(b"\xff")),
                ("MAX_TOKENS", "INT32", [1], int32_raw([3])),
            ],
            "not UTF-8",
        ),
        (
            [
                ("PROMPT_TOKEN_IDS", "INT64", [1], struct.pack("<q", 2**40)),
                ("MAX_TOKENS", "INT32", [1], int32_raw([3])),
            ],
            "outside INT32",
        ),
        ([("PROMPT_TOKEN_IDS", "INT32", [1], int32_raw([1]))], "'MAX_TOKENS' is missing"),
    ],
)
def test_bad_requests_say_what_is_wrong(inputs, needle) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        model.to_stream_request(_request(*inputs))


def test_raw_contents_must_cover_every_input_and_outputs_must_exist() -> None:
    request = _request(("MAX_TOKENS", "INT32", [1], int32_raw([3])))
    request.inputs.add(name="PROMPT_TOKEN_IDS", datatype="INT32", shape=[1])
    with pytest.raises(InvalidRequest, match="raw_input_contents has 1 entries for 2 inputs"):
        model.to_stream_request(request)
    request = _request(("MAX_TOKENS", "INT32", [1], int32_raw([3])))
    request.outputs.add(name="LOGITS")
    with pytest.raises(InvalidRequest, match="unknown output 'LOGITS'"):
        model.to_stream_request(request)


def test_metadata_and_config_describe_the_same_tensors() -> None:
    metadata, config = model.metadata("m"), model.config("m")
    assert [t.name for t in metadata.inputs] == [i.name for i in config.input]
    assert [t.name for t in metadata.outputs] == [o.name for o in config.output]
    assert config.model_transaction_policy.decoupled and config.name == metadata.name == "m"


def test_the_lab_builds_requests_for_any_model() -> None:
    plan = RequestPlan("bench-1", [5, 6], 9)
    default = build_request(KServeTarget("cadence"), plan)
    assert [(t.name, list(t.shape)) for t in default.inputs] == [
        ("PROMPT_TOKEN_IDS", [2]),
        ("MAX_TOKENS", [1]),
    ]
    assert default.raw_input_contents[1] == int32_raw([9])
    assert default.parameters["triton_enable_empty_final_response"].bool_param
    peer = build_request(KServeTarget("tokens", parse_inputs("N=max_tokens, DELAY_MS=10")), plan)
    assert [t.name for t in peer.inputs] == ["N", "DELAY_MS"]
    assert list(peer.raw_input_contents) == [int32_raw([9]), int32_raw([10])]
    batched = build_request(KServeTarget("t", parse_inputs("N=max_tokens:batched,P=prompt")), plan)
    assert [list(t.shape) for t in batched.inputs] == [[1, 1], [2]]  # a batching model's N
    assert list(batched.raw_input_contents) == [int32_raw([9]), int32_raw([5, 6])]
    for bad in ("N", "N=soon", "", "N=soon:batched", "N=max_tokens:later"):
        with pytest.raises(ValueError):
            parse_inputs(bad)


def test_the_lab_counts_tokens_per_response() -> None:
    response = kpb.ModelInferResponse()
    assert _tokens_in(response) == 0  # the final flag alone
    response.outputs.add(name="TOKEN", datatype="INT32", shape=[1])
    assert _tokens_in(response) == 1  # one per response under another name
    response.outputs.add(name="TOKEN_IDS", datatype="INT32", shape=[3])
    assert _tokens_in(response) == 3

"""The hand-encoded ModelStreamInferResponse equals one built with the message API."""

from __future__ import annotations

import pytest

from cadence.api.kserve.responses import ResponseEncoder
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.kserve.tensors import bytes_raw, int32_raw


def _expected(tokens, text, finish, *, want_tokens=True, want_text=True, request_id="r-1"):
    response = kpb.ModelStreamInferResponse()
    infer = response.infer_response
    infer.model_name, infer.model_version, infer.id = "cadence", "1", request_id
    infer.parameters["triton_final_response"].bool_param = finish is not None
    if finish is not None:
        infer.parameters["finish_reason"].string_param = finish
    if want_tokens:
        infer.outputs.add(name="TOKEN_IDS", datatype="INT32", shape=[len(tokens)])
        infer.raw_output_contents.append(int32_raw(tokens))
    if want_text:
        infer.outputs.add(name="TEXT", datatype="BYTES", shape=[1])
        infer.raw_output_contents.append(bytes_raw(text.encode()))
    return response


@pytest.mark.parametrize(
    ("tokens", "text", "finish"),
    [
        ([104], "h", None),
        ([104, 105, 33], "hi!", "length"),
        (list(range(300)), "é" * 150, "stop"),
        ([2**31 - 1, -5], "", "cancelled"),
    ],
)
@pytest.mark.parametrize(("want_tokens", "want_text"), [(True, True), (True, False), (False, True)])
def test_chunk_responses_decode_to_the_message(tokens, text, finish, want_tokens, want_text):
    encoder = ResponseEncoder("cadence", "1", "r-1", want_tokens, want_text)
    decoded = kpb.ModelStreamInferResponse.FromString(encoder.chunk(tokens, text, finish))
    assert decoded == _expected(tokens, text, finish, want_tokens=want_tokens, want_text=want_text)
    # A non-final response still carries the flag, false, as Triton's do.
    assert decoded.infer_response.parameters["triton_final_response"].HasField("bool_param")


def test_final_flag_alone_and_long_ids():
    request_id = "x" * 300  # a length that needs a two-byte varint
    encoder = ResponseEncoder("m", "1", request_id, True, True)
    decoded = kpb.ModelStreamInferResponse.FromString(encoder.final_only("length"))
    expected = kpb.ModelStreamInferResponse()
    expected.infer_response.model_name, expected.infer_response.id = "m", request_id
    expected.infer_response.parameters["triton_final_response"].bool_param = True
    expected.infer_response.parameters["finish_reason"].string_param = "length"
    assert decoded == expected and not decoded.infer_response.outputs

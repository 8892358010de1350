"""A request's priority and its cached_tokens on each protocol's wire: cadence.v1 fields,
OpenAI's `priority` (vLLM's: an integer, lower first) and `usage.prompt_tokens_details`,
KServe's `priority` request parameter and `cached_tokens` on the final response."""

from __future__ import annotations

import json

import pytest

from cadence.api.kserve import model
from cadence.api.kserve.responses import ResponseEncoder
from cadence.api.openai.protocol import COMPLETIONS, Encoder, parse
from cadence.api.v1.service import to_chunk, to_request
from cadence.core.errors import InvalidRequest
from cadence.core.requests import Chunk
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.kserve.tensors import int32_raw
from cadence.proto.v1 import inference_pb2 as pb
from cadence.vocabulary import Finish


def test_cadence_v1_carries_priority_in_and_cached_tokens_on_the_last_chunk():
    raw = pb.GenerateRequest(prompt="hi", max_tokens=3, priority=-4).SerializeToString()
    assert to_request(raw).priority == -4
    assert to_chunk(Chunk(0, [1], "a", Finish.NONE, 2, None, 32), "r").cached_tokens == 0
    assert to_chunk(Chunk(1, [2], "b", Finish.LENGTH, 0, None, 32), "r").cached_tokens == 32


def test_openai_priority_as_vllm_accepts_it_and_cached_tokens_in_usage():
    body = {"model": "m", "prompt": "hi", "priority": 3}
    assert parse(json.dumps(body).encode(), COMPLETIONS, default_max_tokens=8).request.priority == 3
    assert (
        parse(b'{"model": "m", "prompt": "hi"}', COMPLETIONS, default_max_tokens=8).request.priority
        == 0
    )
    with pytest.raises(InvalidRequest) as bad:
        parse(
            b'{"model": "m", "prompt": "hi", "priority": "high"}', COMPLETIONS, default_max_tokens=8
        )
    assert bad.value.parameter == "priority"
    encoder = Encoder(COMPLETIONS, "m")
    encoder.count(Chunk(0, [1, 2], "ab", Finish.LENGTH, 40, None, 32))
    assert encoder.usage()["prompt_tokens_details"] == {"cached_tokens": 32}
    plain = Encoder(COMPLETIONS, "m")
    plain.count(Chunk(0, [1], "a", Finish.LENGTH, 40))
    assert "prompt_tokens_details" not in plain.usage()


def _stream_request(**parameters) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="cadence")
    request.inputs.add(name="MAX_TOKENS", datatype="INT32", shape=[1])
    request.raw_input_contents.append(int32_raw([4]))
    for key, (kind, value) in parameters.items():
        setattr(request.parameters[key], kind, value)
    return request


def test_kserve_priority_parameter_and_cached_tokens_on_the_final_response():
    assert model.to_stream_request(_stream_request()).request.priority == 0
    ask = _stream_request(priority=("uint64_param", 2))  # as tritonclient's `priority=` sends
    assert model.to_stream_request(ask).request.priority == 2
    ask = _stream_request(priority=("int64_param", -1))
    assert model.to_stream_request(ask).request.priority == -1
    with pytest.raises(InvalidRequest, match="priority"):
        model.to_stream_request(_stream_request(priority=("string_param", "high")))
    encoder = ResponseEncoder("cadence", "1", "r", True, True)
    final = kpb.ModelStreamInferResponse.FromString(encoder.chunk([5], "x", "length", 48))
    assert final.infer_response.parameters["cached_tokens"].int64_param == 48
    middle = kpb.ModelStreamInferResponse.FromString(encoder.chunk([5], "x", None, 48))
    assert "cached_tokens" not in middle.infer_response.parameters
    alone = kpb.ModelStreamInferResponse.FromString(encoder.final_only("stop", 300))
    assert alone.infer_response.parameters["cached_tokens"].int64_param == 300

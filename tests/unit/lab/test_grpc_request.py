"""The any-service path's pieces that need no server: method names, the request template with
its placeholders, headers, and how a response message is counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.lab.load.grpc_schema import SchemaError, from_protos, message_classes, split_method
from cadence.lab.load.grpc_service import GrpcCodec, GrpcTarget, RequestTemplate, parse_header
from cadence.lab.load.plan import RequestShape
from cadence.lab.records import RequestRecord

PROTO = str(Path(__file__).resolve().parents[3] / "proto")
SCHEMA = from_protos(["cadence/v1/inference.proto"], [PROTO], "cadence.v1.Inference/Generate")
REQUEST, CHUNK = message_classes(SCHEMA)
PLAN = RequestShape(prompt_tokens=(5, 5), max_tokens=(9, 9)).request(7)


def test_method_names():
    assert split_method("cadence.v1.Inference/Generate") == ("cadence.v1.Inference", "Generate")
    assert split_method("/cadence.v1.Inference/Generate") == ("cadence.v1.Inference", "Generate")
    assert split_method("cadence.v1.Inference.Generate") == ("cadence.v1.Inference", "Generate")
    with pytest.raises(SchemaError, match="expected PACKAGE.SERVICE/METHOD"):
        split_method("Generate")


def test_schema_from_protos():
    assert (SCHEMA.request_type, SCHEMA.response_type) == (
        "cadence.v1.GenerateRequest",
        "cadence.v1.GenerateChunk",
    )
    assert SCHEMA.server_streaming and not SCHEMA.client_streaming
    assert SCHEMA.path == "/cadence.v1.Inference/Generate" and SCHEMA.source == "protos"
    with pytest.raises(SchemaError, match="has no method 'Nope' \\(it has: Generate\\)"):
        from_protos(["cadence/v1/inference.proto"], [PROTO], "cadence.v1.Inference/Nope")


@pytest.mark.parametrize(
    "text",
    [
        # string and integer fields, a nested message, a JSON (camelCase) name: set in place
        '{"request_id": "{request_id}", "prompt": "{prompt}", "maxTokens": "{max_tokens}", '
        '"sampling": {"seed": "{i}", "temperature": 0.5}, "prompt_token_ids": [1, 2]}',
        # a placeholder inside a list: the JSON is parsed again for each request
        '{"request_id": "{request_id}", "prompt": "{prompt}", "maxTokens": "{max_tokens}", '
        '"sampling": {"seed": "{i}", "temperature": 0.5}, "prompt_token_ids": [1, 2], '
        '"stop_token_ids": ["{i}"]}',
    ],
)
def test_placeholders_are_replaced_per_request(text):
    message = RequestTemplate(REQUEST, text).message(PLAN)
    prompt = bytes(PLAN.prompt_token_ids).decode()
    assert message.request_id == "bench-7" and message.prompt == prompt
    assert message.max_tokens == 9 and message.sampling.seed == 7
    assert message.sampling.temperature == 0.5 and list(message.prompt_token_ids) == [1, 2]
    # The same request as protobuf's own JSON parser makes of the filled-in JSON.
    filled = (
        text.replace('"{request_id}"', '"bench-7"')
        .replace('"{max_tokens}"', "9")
        .replace('"{i}"', "7")
        .replace('"{prompt}"', json.dumps(prompt))
    )
    expected = REQUEST()
    from google.protobuf import json_format

    json_format.Parse(filled, expected)
    assert message == expected


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"max_tokens": "{prompt}"}', "max_tokens cannot hold {prompt}"),
        ('{"promptx": 1}', 'no field named "promptx"'),
        ('{"max_tokens": "many"}', "Failed to parse max_tokens field"),
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
    ],
)
def test_bad_requests_say_what_to_fix(text, error):
    with pytest.raises(SchemaError, match=error):
        RequestTemplate(REQUEST, text).message(PLAN)


def test_headers():
    assert parse_header("Authorization=Bearer x=y") == ("authorization", "Bearer x=y")
    assert parse_header("x-tenant: blue") == ("x-tenant", "blue")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_header("nothing")


def codec(**fields) -> GrpcCodec:
    return GrpcCodec(GrpcTarget(schema=SCHEMA, request_json="{}", **fields))


def decoded(c: GrpcCodec, chunks: list) -> RequestRecord:
    record = RequestRecord(request_id="r", process=0, start_ns=0)
    c.decode(record, [chunk.SerializeToString() for chunk in chunks])
    return record


def test_messages_count_as_tokens_by_field():
    chunks = [
        CHUNK(index=0, token_ids=[1, 2, 3], text="abc"),
        CHUNK(index=3, token_ids=[4], text="d"),
    ]
    by_list = decoded(codec(tokens_field="token_ids", index_field="index"), chunks)
    assert (by_list.tokens, by_list.index) == ([3, 1], [0, 3])
    by_string = decoded(codec(tokens_field="text"), [*chunks, CHUNK(index=4)])
    assert by_string.tokens == [1, 1, 0]  # an empty string counts none
    by_number = decoded(codec(tokens_field="index"), chunks)
    assert by_number.tokens == [0, 3]
    nested = decoded(codec(tokens_field="timing.worker"), [CHUNK(timing={"worker": 2})])
    assert nested.tokens == [2]
    plain = decoded(codec(), chunks)
    assert (plain.tokens, plain.index) == ([1, 1], [0, 1])  # positions counted by the client


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"tokens_field": "tokens"}, "--tokens-field: cadence.v1.GenerateChunk has no field"),
        ({"tokens_field": "timing"}, "is not a count, a list or a string"),
        ({"index_field": "text"}, "--index-field: text is not an integer"),
    ],
)
def test_response_fields_that_do_not_fit(fields, error):
    with pytest.raises(SchemaError, match=error):
        codec(**fields)

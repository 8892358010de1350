"""The OpenAI wire without HTTP: request bodies to the core's Request, events, stop strings,
chat templates."""

from __future__ import annotations

import json

import msgspec
import pytest

from cadence.api.openai.chat import PlainChat, load_template
from cadence.api.openai.protocol import (
    CHAT,
    COMPLETIONS,
    Encoder,
    StopStrings,
    error_response,
    parse,
)
from cadence.config import ServerConfig
from cadence.core.errors import InvalidRequest, RequestError
from cadence.core.generation import FrontCore
from cadence.core.metrics import OPENAI, FrontMetrics
from cadence.core.requests import Chunk, Request
from cadence.router import WorkerRouter
from cadence.vocabulary import Failure, Finish, Sampling


def _parse(body: dict, endpoint: str = COMPLETIONS):
    return parse(json.dumps(body).encode(), endpoint, default_max_tokens=99)


def test_completion_fields_map_to_the_core_request() -> None:
    wire = _parse(
        {
            "model": "m",
            "prompt": "Hi",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "x",
            "stop_token_ids": [2],
            "user": "u",
            "stream": True,
            "stream_options": {"include_usage": True},
            "cadence_timing": True,
            "cadence_timeout_s": 2,
        }
    )
    request = wire.request
    assert (
        request.prompt,
        request.max_tokens,
        request.sampling,
        request.include_timing,
    ) == ("Hi", 7, Sampling(temperature=0.5, top_p=0.9, seed=3, stop_token_ids=(2,)), True)
    assert wire.stream and wire.include_usage and wire.stops == ["x"]
    assert wire.timeout_s == 2.0 and wire.model == "m"


def test_defaults_and_prompt_forms() -> None:
    assert _parse({"model": "m", "prompt": "Hi"}).request.max_tokens == 16
    assert _parse({"model": "m", "prompt": [5, 6]}).request.prompt_token_ids == [5, 6]
    assert _parse({"model": "m", "prompt": ["Hi"]}).request.prompt == "Hi"
    assert (
        _parse({"model": "m", "prompt": "Hi", "max_completion_tokens": 4}).request.max_tokens == 4
    )
    chat = _parse(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        },
        CHAT,
    )
    assert chat.messages == [{"role": "user", "content": "ab"}]
    assert chat.request.max_tokens == 99


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": "Hi", "n": 2}, "n"),
        ({"model": "m", "prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "Hi", "temperature": 3}, "temperature"),
        ({"model": "m", "prompt": "Hi", "top_p": "x"}, "top_p"),
        ({"model": "m", "prompt": "Hi", "stop": ["a"] * 5}, "stop"),
        ({"model": "m", "prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"model": "m", "prompt": "Hi", "stream": "yes"}, "stream"),
        (
            {"model": "m", "prompt": "Hi", "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
    ],
)
def test_invalid_fields_are_named(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        _parse(body)
    assert info.value.parameter == param
    # As the body names it, in the error body too.
    status, error = error_response(info.value, COMPLETIONS)
    assert status == 400 and json.loads(error)["error"]["param"] == param


def test_chat_needs_messages_and_a_body_must_be_json() -> None:
    with pytest.raises(InvalidRequest) as info:
        _parse({"model": "m", "messages": []}, CHAT)
    assert info.value.parameter == "messages"
    with pytest.raises(InvalidRequest) as info:
        parse(b"{not json", COMPLETIONS, default_max_tokens=1)
    assert info.value.parameter is None


@pytest.mark.parametrize(
    ("request_fields", "param", "chat_param"),
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens", "max_tokens"),
        ({"prompt": ""}, "prompt", "messages"),
        ({"prompt": "x" * 300}, "prompt", "messages"),
        ({"prompt": "", "prompt_token_ids": [-1]}, "prompt", "messages"),
        ({"sampling": Sampling(temperature=-1.0)}, "temperature", "temperature"),
        ({"sampling": Sampling(top_p=1.5)}, "top_p", "top_p"),
        ({"sampling": Sampling(top_k=2**32)}, "top_k", "top_k"),
        ({"sampling": Sampling(seed=2**64)}, "seed", "seed"),
        ({"sampling": Sampling(stop_token_ids=(-1,))}, "stop_token_ids", "stop_token_ids"),
        ({"priority": 2**31}, "priority", "priority"),
    ],
)
def test_the_cores_refusals_name_the_bodys_field(
    request_fields: dict, param: str, chat_param: str
) -> None:
    """The core names the field of its Request that a refusal is about; `error_response`,
    the one map to the OpenAI wire, names the body's, without reading the message."""
    core = FrontCore(ServerConfig(max_prompt_tokens=256), [], WorkerRouter(1), FrontMetrics())
    core.refusal = None
    fields = {"prompt": "Hi", "max_tokens": 4, **request_fields}
    with pytest.raises(InvalidRequest) as info:
        core.open(Request(**fields), 0, lambda: None, protocol=OPENAI)
    refusal = info.value
    for endpoint, expected in ((COMPLETIONS, param), (CHAT, chat_param)):
        status, body = error_response(refusal, endpoint)
        error = json.loads(body)["error"]
        assert (status, error["param"], error["message"]) == (400, expected, refusal.message)


def test_a_refusal_about_no_one_field_has_no_param() -> None:
    status, body = error_response(RequestError(Failure.UNAVAILABLE, "draining"), CHAT)
    assert status == 503 and json.loads(body)["error"]["param"] is None


def test_stop_strings_hold_back_a_possible_start_and_cut_at_a_match() -> None:
    stops = StopStrings(["END", "##"])
    assert stops.feed("abc E", False) == "abc "
    assert stops.feed("N", False) == ""
    assert stops.feed("x", False) == "ENx"
    assert not stops.matched
    assert stops.feed("y#", False) == "y"
    assert stops.feed("#tail", False) == ""
    assert stops.matched
    assert StopStrings(["zz"]).feed("z", True) == "z"  # the end flushes what was held


def test_streamed_events_and_usage() -> None:
    encoder = Encoder(CHAT, "m", usage_null=True)
    first = Chunk(0, [1, 2], "ab", Finish.NONE, prompt_tokens=5)
    encoder.count(first)
    event = encoder.event("ab", None)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    body = json.loads(event[6:])
    assert body["object"] == "chat.completion.chunk" and body["model"] == "m"
    assert body["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "ab"},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert body["usage"] is None
    encoder.count(Chunk(2, [3], "c", Finish.LENGTH))
    assert json.loads(encoder.event("c", None)[6:])["choices"][0]["delta"] == {"content": "c"}
    last = json.loads(encoder.event("", "length")[6:])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert last["usage"] is None
    usage = json.loads(encoder.usage_event()[6:])
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
    }
    text = Encoder(COMPLETIONS, "m")
    whole = json.loads(text.whole("hi", "stop"))
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "hi"


def test_plain_chat_format() -> None:
    assert PlainChat().render(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    ) == ("system: Be terse.\nuser: Hi\nassistant:")


_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)


@pytest.mark.torch
def test_a_checkpoint_template_gives_transformers_token_ids(tmp_path) -> None:
    """The rendered prompt, tokenized as the torch worker tokenizes it, is exactly
    transformers' `apply_chat_template(..., add_generation_prompt=True)` (one BOS)."""
    pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")
    pytest.importorskip("jinja2", reason="chat templates need the torch extra's jinja2")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from cadence.engines.llama.tokenizer import TextTokenizer
    from tests.llama_models import build_tokenizer

    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = _TEMPLATE
    hf.save_pretrained(tmp_path)
    messages = [{"role": "system", "content": "the dog"}, {"role": "user", "content": "a fox"}]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected = getattr(expected, "input_ids", expected)
    template = load_template(tmp_path)
    assert template is not None
    assert TextTokenizer(tmp_path).encode(template.render(messages)) == list(expected)


def test_the_template_file_wins_and_no_template_means_none(tmp_path) -> None:
    pytest.importorskip("jinja2", reason="chat templates need the torch extra's jinja2")
    assert load_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}?"}]}
        )
    )
    messages = [{"role": "user", "content": "Hi"}]
    assert load_template(tmp_path).render(messages) == "Hi?"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_template(tmp_path).render(messages) == "Hi!"


def test_the_lab_counts_each_text_event_as_one_position_and_keeps_usage_beside() -> None:
    from cadence.lab.load.openai_http import decode_events
    from cadence.lab.records import RequestRecord

    def event(body: dict) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n"

    events = [
        event({"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]}),
        event({"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "length"}]}),
        event({"choices": [], "usage": {"completion_tokens": 5}}),
    ]
    record = RequestRecord(request_id="r", process=0, start_ns=0, arrival_ns=[1, 2, 3])
    decode_events(record, events, include_timing=False)
    # usage (5) is compared with the two events, never spread over them
    assert (record.arrival_ns, record.tokens, record.index) == ([1, 2], [1, 1], [0, 1])
    assert record.usage_outputs == 5
    assert record.output_tokens == 5  # tokens/s in the server's tokens
    assert record.finish_reason == 1
    failed = RequestRecord(request_id="r", process=0, start_ns=0, arrival_ns=[1])
    decode_events(failed, [event({"error": {"code": "unavailable", "message": "gone"}})], False)
    assert (failed.code, failed.error) == ("UNAVAILABLE", "gone")


def test_the_lab_says_when_nothing_answers_http() -> None:
    import socket

    from cadence.lab.load.openai_http import OpenAITarget, require_http

    with socket.socket() as bound:  # bound, never listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with pytest.raises(RuntimeError, match="no HTTP server answers"):
            require_http(OpenAITarget(f"http://127.0.0.1:{port}", "m"), timeout=2)


def test_completion_events_with_timing_and_each_finish() -> None:
    from cadence.core.requests import ChunkTiming

    encoder = Encoder(COMPLETIONS, "m")
    timing = ChunkTiming(worker=1, step_start_ns=5, step_end_ns=9, send_ns=11)
    body = json.loads(
        encoder.event('say "hi"\n', None, Chunk(4, [1, 2], "x", Finish.NONE, timing=timing))[6:]
    )
    assert body["choices"] == [
        {"index": 0, "text": 'say "hi"\n', "logprobs": None, "finish_reason": None}
    ]
    assert "usage" not in body
    assert body["cadence"] == {"index": 4, "tokens": 2, "timing": msgspec.to_builtins(timing)}
    for finish in ("length", "stop"):
        assert json.loads(encoder.event("", finish)[6:])["choices"][0]["finish_reason"] == finish

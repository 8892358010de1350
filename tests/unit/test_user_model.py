"""A user's batched model (tests/batched_models.py) behind ModelEngine, stepped by a real
BatchScheduler in this process: outputs, finishes, failures, detokenization."""

from __future__ import annotations

import pytest

import cadence
from cadence.config import EngineConfig
from cadence.core.stream import MAX_CHUNK_BYTES, TOKEN_ID_BYTES
from cadence.engines.base import EngineLoadError
from cadence.engines.detokenizer import TextStreams
from cadence.engines.output_text import MAX_OUTPUT_BYTES, MAX_OUTPUT_TOKENS
from cadence.engines.user_model import ModelEngine
from cadence.transport.messages import RequestFailed, StepOutput, step_pieces
from cadence.vocabulary import AddRequest, Failure, Finish, Sampling
from cadence.worker.batch_scheduler import BatchScheduler
from tests import batched_models
from tests.batched_models import WordTokenizer


@pytest.fixture(autouse=True)
def no_step_time(monkeypatch) -> None:
    monkeypatch.setattr(batched_models, "STEP_S", 0.0)


def engine(name: str = "EchoModel", **config) -> ModelEngine:
    return ModelEngine(
        EngineConfig(name="model", model_class=f"tests.batched_models:{name}", **config), "cpu"
    )


def text_request(seq_id: int, prompt: str, max_tokens: int = 50, **kw) -> AddRequest:
    return AddRequest(seq_id, [], max_tokens, prompt_text=prompt, **kw)


def run(scheduler: BatchScheduler, limit: int = 1000) -> list[StepOutput | list[RequestFailed]]:
    outs = []
    for _ in range(limit):
        out = scheduler.step()
        if out is None:
            return outs
        outs.append(out)
    raise AssertionError("the scheduler did not run out of work")


def streamed(outs: list, seq_id: int) -> tuple[list[int], str, int]:
    """A sequence's token ids, text and finish reason over a run."""
    tokens: list[int] = []
    text = ""
    finish = Finish.NONE
    for out in outs:
        if type(out) is not StepOutput:
            continue
        for sid, piece, piece_text in step_pieces(out):
            if sid == seq_id:
                tokens += [piece] if type(piece) is int else piece
                text += piece_text
        if seq_id in out.finished_ids:
            finish = out.finish_reasons[out.finished_ids.index(seq_id)]
    return tokens, text, finish


def test_sequence_is_public_with_the_request_fields() -> None:
    seq = cadence.Sequence(
        AddRequest(7, [104, 105], 9, Sampling(0.5, 0.9, 40, 11, (3,)), prompt_text="hi")
    )
    assert (seq.seq_id, seq.prompt, seq.prompt_token_ids) == (7, "hi", [104, 105])
    assert seq.max_tokens == 9
    assert seq.sampling == Sampling(0.5, 0.9, 40, 11, (3,))
    # Each field on its own too, as user models have read them.
    assert (seq.temperature, seq.top_p, seq.top_k, seq.seed) == (0.5, 0.9, 40, 11)
    assert seq.stop_token_ids == {3} and seq.generated == 0 and seq.state is None


def test_int_str_and_none_outputs_with_their_finishes() -> None:
    s = BatchScheduler(engine(), worker=0, max_batch=8)
    assert s.add(text_request(1, "count 12")) is None  # bytes, then None: STOP
    assert s.add(text_request(2, "count 99", max_tokens=5)) is None  # LENGTH
    assert s.add(text_request(3, "batch", max_tokens=3)) is None  # text pieces
    assert (
        s.add(text_request(4, "abc", max_tokens=9, sampling=Sampling(stop_token_ids=(99,)))) is None
    )  # stop token
    outs = run(s)
    assert streamed(outs, 1) == (list(b"012345678901"), "012345678901", Finish.STOP)
    assert streamed(outs, 2) == (list(b"01234"), "01234", Finish.LENGTH)
    assert streamed(outs, 3) == (list(b"4 4 4 "), "4 4 4 ", Finish.LENGTH)
    assert streamed(outs, 4) == (list(b"abc"), "abc", Finish.STOP)
    # "4 " is one output of two ids: the step says each piece is one position.
    assert all(o.piece_outputs == bool(o.token_counts) for o in outs)
    assert any(o.piece_outputs for o in outs)


def test_token_id_prompts_get_their_text() -> None:
    s = BatchScheduler(engine(), worker=0, max_batch=8)
    assert s.add(AddRequest(1, list(b"count 3"), 10)) is None
    assert streamed(run(s), 1)[1] == "012"


def test_a_raising_step_fails_its_sequences_and_the_engine_goes_on() -> None:
    s = BatchScheduler(engine(), worker=0, max_batch=8)
    for seq_id, prompt in ((1, "count 50"), (2, "fail")):
        assert s.add(text_request(seq_id, prompt)) is None
    outs = run(s)
    failures = outs[-1]
    assert type(failures) is list and {f.seq_id for f in failures} == {1, 2}
    assert {(f.failure, f.message) for f in failures} == {
        (Failure.INTERNAL, "EchoModel.step raised ValueError: failed on purpose")
    }
    assert s.add(text_request(3, "count 4")) is None
    assert streamed(run(s), 3)[1:] == ("0123", Finish.STOP)


@pytest.mark.parametrize(
    ("outputs", "problem"),
    [
        ([1, 2, 3], "returned 3 outputs for 2 sequences"),
        ((1 // n for n in [1, 0]), "returned a generator whose iteration raised ZeroDivisionError"),
        (7, "returned a int; return a list"),
    ],
)
def test_wrong_outputs_fail_the_step(outputs, problem) -> None:
    model_engine = engine()
    model_engine._step = lambda prefill, decode: outputs
    s = BatchScheduler(model_engine, worker=0, max_batch=8)
    assert s.add(text_request(1, "x")) is None and s.add(text_request(2, "y")) is None
    failures = s.step()
    assert [f.seq_id for f in failures] == [1, 2]
    assert all(problem in f.message for f in failures)


@pytest.mark.parametrize(
    ("outputs", "problem"),
    [
        ([1, 2], "EchoModel.step returned 2 outputs for 1 sequence; return one per sequence"),
        ([], "EchoModel.step returned 0 outputs for 1 sequence;"),
    ],
)
def test_counts_in_messages_read_as_plain_english(outputs, problem) -> None:
    model_engine = engine()
    model_engine._step = lambda prefill, decode: outputs
    s = BatchScheduler(model_engine, worker=0, max_batch=8)
    assert s.add(text_request(1, "x")) is None
    (failure,) = s.step()
    assert failure.message.startswith(problem), failure.message
    from cadence.engines.batch_generator import BatchGenerator

    shape = BatchGenerator(lambda batch: iter([[]]), "StreamModel", 8, 0.0, None)
    seq = cadence.Sequence(text_request(1, "x"))
    with pytest.raises(ValueError, match="yielded 0 outputs for a batch of 1 sequence; yield"):
        shape.step([seq], [])


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (3.5, "EchoModel.step returned a float for this request"),
        (300, "EchoModel.step returned token id 300, but the model has no tokenizer"),
        ("x" * (2 << 20), "a text of 2,097,152 bytes, over the 1,048,576 bytes (1 MiB)"),
        ("é" * (1 << 20), "a text of 2,097,152 bytes"),
        (
            "ok \ud800",
            ("a text that UTF-8 cannot carry (surrogates not allowed: '\\ud800' at character 3)"),
        ),
        (ValueError("no good"), "EchoModel.step failed this request: ValueError: no good"),
    ],
)
def test_a_bad_output_fails_its_sequence_alone(bad, problem) -> None:
    """A wrong output, or an exception in a sequence's place, ends that sequence with
    INTERNAL; the step's other sequences get their outputs and go on."""
    model_engine = engine()
    model_engine._step = lambda prefill, decode: [
        bad if seq.seq_id == 2 and seq.generated == 1 else "ok" for seq in prefill + decode
    ]
    s = BatchScheduler(model_engine, worker=0, max_batch=8)
    for seq_id in (1, 2, 3):
        assert s.add(text_request(seq_id, "x", max_tokens=4)) is None
    outs = []
    while (out := s.step()) is not None:
        outs.append(out)
        if s.failed:
            (failure,) = s.failed
            assert len(outs) == 2 and out.seq_ids == [1, 3]
            s.failed.clear()
    assert failure.seq_id == 2 and failure.failure == Failure.INTERNAL
    assert problem in failure.message
    assert streamed(outs, 1)[1:] == streamed(outs, 3)[1:] == ("okokokok", Finish.LENGTH)
    assert streamed(outs, 2)[1:] == ("ok", Finish.NONE)
    assert model_engine.step_errors == [] and not s.has_work


def test_a_sequence_error_ends_its_sequence_with_its_status_and_message() -> None:
    s = BatchScheduler(engine(), worker=0, max_batch=8)
    for seq_id, prompt in ((1, "count 6"), (2, "refuse"), (3, "fail-alone")):
        assert s.add(text_request(seq_id, prompt)) is None
    outs = run(s)
    assert streamed(outs, 1)[1:] == ("012345", Finish.STOP)
    assert {(f.seq_id, f.failure, f.message) for f in s.failed} == {
        (2, Failure.RESOURCE_EXHAUSTED, "no room for this one"),
        (3, Failure.INTERNAL, "EchoModel.step failed this request: ValueError: failed on purpose"),
    }
    with pytest.raises(ValueError, match="status must be one of INVALID_ARGUMENT"):
        cadence.SequenceError("x", status="OOPS")


def test_a_text_of_too_many_ids_fails_its_sequence_alone() -> None:
    """One output and its ids fit one chunk the front sends; a text over MAX_OUTPUT_TOKENS
    ids (bytes, without a tokenizer) fails its sequence, not the others of its step."""
    assert MAX_OUTPUT_BYTES + TOKEN_ID_BYTES * MAX_OUTPUT_TOKENS <= MAX_CHUNK_BYTES
    model_engine = engine()
    model_engine._step = lambda prefill, decode: [
        "x" * (MAX_OUTPUT_TOKENS + 1) if seq.seq_id == 1 else "ok" for seq in prefill + decode
    ]
    s = BatchScheduler(model_engine, worker=0, max_batch=8)
    assert s.add(text_request(1, "x")) is None and s.add(text_request(2, "y")) is None
    output = s.step()
    assert output.seq_ids == [2] and output.texts == ["ok"]
    (failure,) = s.failed
    assert failure.seq_id == 1 and failure.failure == Failure.INTERNAL
    assert failure.message.startswith("EchoModel.step returned a text of 262,145 token ids")


def test_numpy_integers_are_token_ids() -> None:
    np = pytest.importorskip("numpy")
    model_engine = engine()
    model_engine._step = lambda prefill, decode: np.array([65] * (len(prefill) + len(decode)))
    s = BatchScheduler(model_engine, worker=0, max_batch=8)
    assert s.add(text_request(1, "x", max_tokens=3)) is None
    assert streamed(run(s), 1) == (list(b"AAA"), "AAA", Finish.LENGTH)


def test_own_vocabulary_streams_ids_above_255_and_holds_back_split_characters() -> None:
    s = BatchScheduler(engine("VocabModel"), worker=0, max_batch=8)
    prompt = "hello héllo wörld"
    ids = WordTokenizer().encode(prompt)
    assert max(ids) >= 1000 and 0xC3 in ids
    assert s.add(text_request(1, prompt, max_tokens=2 * len(ids))) is None
    outs = run(s)
    tokens, text, finish = streamed(outs, 1)
    assert tokens == ids * 2 and text == prompt * 2 and finish == Finish.LENGTH
    pieces = [t for out in outs for _, _, t in step_pieces(out)]
    assert "\ufffd" not in "".join(pieces) and "" in pieces  # the é waited for its 2nd byte


def test_prompt_ids_outside_the_vocabulary_are_refused() -> None:
    s = BatchScheduler(engine(), worker=0, max_batch=8)
    failure = s.add(AddRequest(1, [300], 5))
    assert failure is not None and failure.failure == Failure.INVALID_ARGUMENT


def test_text_streams_decode_any_tokenizer_incrementally() -> None:
    streams = TextStreams(WordTokenizer())
    ids = streams.encode("wörld héllo")
    decode = streams.stream([])
    pieces = [decode(t, i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == "wörld héllo" and "" in pieces


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("NoSuchModel", "cannot load model 'tests.batched_models:NoSuchModel': AttributeError"),
        ("NoStepModel", "has no step(prefill, decode) method"),
        ("BrokenInitModel", "BrokenInitModel('cpu') raised RuntimeError: no weights at /nowhere"),
        ("WordTokenizer", "has no step"),
    ],
)
def test_load_errors_say_what_to_fix(name, problem) -> None:
    with pytest.raises(EngineLoadError) as info:
        engine(name)
    assert problem in str(info.value)


def test_max_batch_is_the_smaller_of_the_models_and_the_servers() -> None:
    class Small(batched_models.EchoModel):
        max_batch = 4

    batched_models.Small = Small
    try:
        assert engine("Small").max_batch == 4
        assert engine("Small", max_batch=2).max_batch == 2
    finally:
        del batched_models.Small


def test_the_example_model_runs_under_the_scheduler() -> None:
    pytest.importorskip("numpy")
    s = BatchScheduler(
        ModelEngine(
            EngineConfig(name="model", model_class="examples.batched_model:BigramModel"), "cpu"
        ),
        worker=0,
        max_batch=512,
    )
    for seq_id in range(1, 301):  # more than its 256 slots: the rest wait for released ones
        assert (
            s.add(text_request(seq_id, "The stream", max_tokens=20, sampling=Sampling(0.7))) is None
        )
    outs = run(s)
    for seq_id in (1, 300):
        tokens, text, finish = streamed(outs, seq_id)
        assert len(tokens) == 20 and finish == Finish.LENGTH and text
    assert max(len(o.seq_ids) for o in outs) == 256
    assert s.add(text_request(301, "The stream", max_tokens=12)) is None  # greedy
    assert streamed(run(s), 301)[1] == "athe s s s s"  # the most likely byte after each


def test_a_hugging_face_tokenizer_works_as_it_is() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["héllo wörld, streams of tökens "] * 50, trainer)
    streams = TextStreams(tokenizer)
    text = "wörld héllo tökens 日本"
    ids = streams.encode(text)
    assert streams.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True) > 256
    assert max(ids) >= 256  # merges above the 256 byte-level symbols
    decode = streams.stream([])
    pieces = [decode(t, i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


# -- the batch-generator shape (generate_stream) ---------------------------------------------


def test_a_generator_batch_runs_to_its_end_before_the_next_starts() -> None:
    s = BatchScheduler(engine("StreamModel", batch_timeout_ms=0), worker=0, max_batch=8)
    for seq_id, prompt in ((1, "batch"), (2, "count 3"), (3, "abc")):
        assert s.add(text_request(seq_id, prompt, max_tokens=6)) is None
    first = s.step()
    assert len(first.seq_ids) == 3
    assert s.add(text_request(4, "batch", max_tokens=2)) is None  # arrives while it runs
    outs = [first, *run(s)]
    assert streamed(outs, 1) == (list(b"3 3 3 3 3 3 "), "3 3 3 3 3 3 ", Finish.LENGTH)
    assert streamed(outs, 2) == (list(b"012"), "012", Finish.STOP)
    assert streamed(outs, 3) == (list(b"abcabc"), "abcabc", Finish.LENGTH)
    # The late one waited for the whole batch, then ran alone.
    assert streamed(outs, 4)[1] == "1 1 "
    last_of_batch = max(i for i, o in enumerate(outs) if 1 in o.seq_ids)
    assert min(i for i, o in enumerate(outs) if 4 in o.seq_ids) > last_of_batch


def test_a_generator_gathers_up_to_max_batch_within_the_timeout() -> None:
    s = BatchScheduler(
        engine("StreamModel", batch_timeout_ms=10_000, max_batch=3), worker=0, max_batch=3
    )
    assert s.add(text_request(1, "batch", max_tokens=2)) is None
    assert s.step() is None  # gathering: the timeout has not passed and the batch is not full
    for seq_id in (2, 3):
        assert s.add(text_request(seq_id, "batch", max_tokens=2)) is None
    assert streamed(run(s), 3)[1] == "3 3 "  # full: it started at once


def test_a_paused_sequence_gets_its_generator_outputs_later_in_order() -> None:
    s = BatchScheduler(engine("StreamModel", batch_timeout_ms=0), worker=0, max_batch=8)
    assert s.add(text_request(1, "count 9", max_tokens=20)) is None
    assert s.add(text_request(2, "abcdef", max_tokens=6)) is None
    outs = [s.step()]
    s.pause([1])
    outs += [s.step(), s.step()]
    s.resume([1])
    outs += run(s)
    assert streamed(outs, 1) == (list(b"012345678"), "012345678", Finish.STOP)
    assert streamed(outs, 2)[1] == "abcdef"


def test_a_raising_generator_fails_its_batch_and_the_next_batch_runs() -> None:
    s = BatchScheduler(engine("StreamModel", batch_timeout_ms=0), worker=0, max_batch=8)
    for seq_id, prompt in ((1, "count 50"), (2, "fail")):
        assert s.add(text_request(seq_id, prompt)) is None
    failures = run(s)[-1]
    assert {(f.seq_id, f.message) for f in failures} == {
        (1, "StreamModel.generate_stream raised ValueError: generator failed on purpose"),
        (2, "StreamModel.generate_stream raised ValueError: generator failed on purpose"),
    }
    assert s.add(text_request(3, "count 4")) is None
    assert streamed(run(s), 3)[1:] == ("0123", Finish.STOP)


def test_an_exception_a_generator_yields_fails_its_sequence_alone() -> None:
    s = BatchScheduler(engine("StreamModel", batch_timeout_ms=0), worker=0, max_batch=8)
    for seq_id, prompt in ((1, "count 5"), (2, "refuse"), (3, "fail-alone")):
        assert s.add(text_request(seq_id, prompt)) is None
    outs = run(s)
    assert streamed(outs, 1)[1:] == ("01234", Finish.STOP)
    assert {(f.seq_id, f.failure, f.message) for f in s.failed} == {
        (2, Failure.RESOURCE_EXHAUSTED, "no room for this one"),
        (
            3,
            Failure.INTERNAL,
            "StreamModel.generate_stream failed this request: ValueError: failed on purpose",
        ),
    }
    assert s.add(text_request(4, "count 2")) is None  # the batch ended: the next one runs
    assert streamed(run(s), 4)[1:] == ("01", Finish.STOP)


# -- the declaration (cadence.Model) ---------------------------------------------------------


def test_a_misspelled_member_is_named_with_what_it_was_meant_to_be() -> None:
    from cadence.engines.model_api import MEMBERS, misspelled_members
    from tests.batched_models import DeclaredModel, MisspelledModel

    assert misspelled_members(MisspelledModel) == [
        (
            "MisspelledModel has `max_batches`: did you mean `max_batch`? (cadence never calls "
            "it; see docs/models.md)"
        ),
        (
            "MisspelledModel has `relase`: did you mean `release`? (cadence never calls it; see "
            "docs/models.md)"
        ),
    ]
    assert misspelled_members(DeclaredModel) == []
    assert misspelled_members(batched_models.EchoModel) == []  # `steps` is an instance's
    assert set(MEMBERS) == {
        "step",
        "generate_stream",
        "reserve",
        "release",
        "check",
        "close",
        "max_batch",
        "tokenizer",
        "takes_prefill_chunks",
        "export_state",
        "import_state",
    }


def test_models_defaults_are_the_same_as_no_member() -> None:
    model_engine = engine("DeclaredModel")
    assert isinstance(model_engine.model, cadence.Model)
    assert isinstance(model_engine.model, cadence.StepModel)
    assert model_engine._check is None and model_engine._release is None
    assert not hasattr(model_engine, "reserve") and model_engine.tokenizer is not None
    assert not model_engine.takes_prefill_chunks
    s = BatchScheduler(model_engine, worker=0, max_batch=8)
    assert s.add(text_request(1, "abc", max_tokens=5)) is None
    assert streamed(run(s), 1)[1:] == ("abcab", Finish.LENGTH)

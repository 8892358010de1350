"""The app engine's contract: pieces to tokens, naming and loading a function, its config,
and the front's handling of several-token pieces."""

from __future__ import annotations

import sys

import pytest

from cadence.byte_tokenizer import ByteTokenizer
from cadence.config import EngineConfig, ServerConfig
from cadence.core.metrics import FrontMetrics, StreamTally
from cadence.core.output_reader import OutputReader
from cadence.core.stream import RequestStream
from cadence.engines.app import app_reference, is_async_app, load_app, piece_tokens
from cadence.lab.sweep import _server_args, parse_vary
from cadence.transport.messages import StepOutput


def test_piece_tokens():
    assert piece_tokens("hé") == list("hé".encode())
    assert piece_tokens([1, 2]) == [1, 2]
    assert piece_tokens(()) == []
    with pytest.raises(TypeError, match="yield str"):
        piece_tokens(b"bytes")
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        piece_tokens([1, 256])
    with pytest.raises(ValueError):
        piece_tokens([1, "a"])
    # Checked before any tokenizer sees them: text no stream can carry, or too much for one piece.
    with pytest.raises(ValueError, match="the app yielded a text that UTF-8 cannot carry"):
        piece_tokens("\ud800", encode=lambda text: [1])
    with pytest.raises(ValueError, match=r"over the 1,048,576 bytes \(1 MiB\) one output"):
        piece_tokens("x" * (2 << 20), encode=lambda text: [1])


def sync_gen(request, context):
    yield "x"


async def async_gen(request, context):
    yield "x"


class AsyncCallable:
    async def __call__(self, request, context):
        yield "x"


def test_sync_or_async():
    import functools

    assert not is_async_app(sync_gen)
    assert is_async_app(async_gen)
    assert is_async_app(functools.partial(async_gen))
    assert is_async_app(AsyncCallable())
    assert not is_async_app(lambda request, context: iter(["x"]))


def test_reference_and_load_roundtrip():
    ref = app_reference(sync_gen)
    assert ref == f"{__name__}:sync_gen"
    assert load_app("tests.apps:sync_app").__name__ == "sync_app"
    assert app_reference("pkg.mod:fn") == "pkg.mod:fn"


def test_functions_a_worker_cannot_import_are_refused():
    def local(request, context):
        yield "x"

    with pytest.raises(ValueError, match="app_in_front"):
        app_reference(local)
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        app_reference("no_colon")


def test_load_by_path(tmp_path):
    script = tmp_path / "my_app.py"
    script.write_text("import sys\nMAIN = __name__\ndef gen(request, context):\n    yield 'x'\n")
    fn = load_app(f"{script}:gen")
    assert sys.modules[fn.__module__].MAIN != "__main__"  # a script's main block does not run


def test_config_needs_an_app_and_threads():
    with pytest.raises(ValueError, match="--app"):
        ServerConfig(engine=EngineConfig(name="app"))
    with pytest.raises(ValueError, match="engine_threads"):
        ServerConfig(engine=EngineConfig(name="app", app="m:f", engine_threads=0))
    with pytest.raises(ValueError, match="app_in_front"):
        ServerConfig(app_in_front=True)
    ServerConfig(engine=EngineConfig(name="app", app="m:f", engine_threads=4), app_in_front=True)


def test_sweep_can_vary_engine_threads():
    name, values = parse_vary("engine_threads=1,2,4,8")
    assert (name, values) == ("engine_threads", ["1", "2", "4", "8"])
    assert _server_args(["--app", "m:f"], name, "4") == ["--app", "m:f", "--engine-threads", "4"]


def _stream(seq_id: int, tally: StreamTally, capacity: int = 64) -> RequestStream:
    return RequestStream(
        seq_id,
        0,
        1,
        capacity=capacity,
        overflow="merge",
        include_timing=False,
        decoder=ByteTokenizer().stream_decoder(),
        received_ns=1,
        tally=tally,
    )


def test_output_reader_splits_pieces_by_token_counts():
    one_tally, two_tally = StreamTally(), StreamTally()
    streams = {1: _stream(1, one_tally), 2: _stream(2, two_tally)}
    reader = OutputReader(streams, lambda message: None, FrontMetrics(), 1)
    reader.handle(StepOutput(0, 1, 10, 20, [1, 2, 1], list(b"hello!?"), [2], [2], [5, 1, 1]), 30)
    one, two = streams[1].take_chunk(), streams[2].take_chunk()
    assert (one.index, one.text) == (0, "hello?")
    assert (two.index, two.text, two.finish) == (0, "!", 2)
    assert one_tally.merged_steps == 1, "a piece of five tokens counts as one step"

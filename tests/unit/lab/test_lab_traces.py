"""The lab's traffic as users' real traffic: traces read and turned into requests (Mooncake's
hash blocks into shared prefixes), conversations whose history grows, and the figures made of
them (latencies from the schedule, TTFT by turn, cached tokens, p99.9)."""

from __future__ import annotations

import itertools
import json
import math

import msgspec
import pytest

from cadence.lab.analysis.stats import summarize
from cadence.lab.load.openai_http import build_body, decode_events
from cadence.lab.load.plan import Conversation, RequestShape
from cadence.lab.load.processes import ProcessPlan, my_requests
from cadence.lab.load.trace import TraceError, read_trace
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult, to_builtins

MOONCAKE = [
    {"timestamp": 1000, "input_length": 700, "output_length": 8, "hash_ids": [0, 1]},
    {"timestamp": 1050, "input_length": 1200, "output_length": 9, "hash_ids": [0, 1, 2]},
    {"timestamp": 1120, "input_length": 300, "output_length": 4, "hash_ids": [5]},
    {"timestamp": 3000, "input_length": 600, "output_length": 6, "hash_ids": [0, 7]},
]


def _jsonl(tmp_path, rows: list[dict], name: str = "trace.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mooncake_rows_share_prefixes_block_by_block(tmp_path) -> None:
    rows = read_trace(_jsonl(tmp_path, MOONCAKE))
    assert [r.offset_s for r in rows] == [0.0, 0.05, 0.12, 2.0]
    shape = RequestShape(trace=rows)
    plans = [shape.request(i) for i in range(4)]
    assert [len(p.prompt_token_ids) for p in plans] == [700, 1200, 300, 600]
    assert [p.max_tokens for p in plans] == [8, 9, 4, 6]
    a, b, c, d = (p.prompt_token_ids for p in plans)
    assert a == b[:700]  # blocks 0 and 1 (the second cut to the length) in both
    assert d[:512] == a[:512] and d[512:] != b[512:600]  # block 0 shared, 7 not 1
    assert c[:300] != a[:300]
    assert all(32 <= t < 127 for t in b)
    assert plans == [RequestShape(trace=rows).request(i) for i in range(4)]  # any process


def test_speed_and_window_rescale_the_trace(tmp_path) -> None:
    path = _jsonl(tmp_path, MOONCAKE)
    assert [r.offset_s for r in read_trace(path, speed=2.0)] == [0.0, 0.025, 0.06, 1.0]
    windowed = read_trace(path, window=(0.04, 1.0))
    assert [(r.offset_s, r.input_length) for r in windowed] == [
        (pytest.approx(0.01), 1200),
        (pytest.approx(0.08), 300),
    ]
    with pytest.raises(TraceError, match="no request in the window 5:6 s"):
        read_trace(path, window=(5.0, 6.0))


def test_plain_csv_with_sessions_and_the_lengths_aliases(tmp_path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(
        "timestamp,input_tokens,output_tokens,session_id,hash_ids\n"
        '0,10,3,a,\n10,20,4,b,1 2\n20,30,5,a,"[3]"\n'
    )
    rows = read_trace(str(path))
    assert [(r.input_length, r.output_length, r.session, r.turn, r.hash_ids) for r in rows] == [
        (10, 3, "a", 1, []),
        (20, 4, "b", 1, [1, 2]),
        (30, 5, "a", 2, [3]),
    ]
    shape = RequestShape(trace=rows, session_header="x-session")
    assert [shape.request(i).headers for i in range(3)] == [
        [("x-session", "a")],
        [("x-session", "b")],
        [("x-session", "a")],
    ]
    assert [shape.request(i).turn for i in range(3)] == [1, 1, 2]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"timestamp": 0, "output_length": 3}\n', r"trace.jsonl:1: no 'input_length'"),
        (
            '{"timestamp": 0, "input_length": 3, "output_length": 3}\nnot json\n',
            r"trace.jsonl:2: not JSON",
        ),
        ('{"timestamp": 0, "input_length": 0, "output_length": 3}\n', "1 or more"),
        ("\n", "holds no requests"),
    ],
)
def test_a_bad_trace_is_named_by_file_and_line(tmp_path, text, error) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match=error):
        read_trace(str(path))


def test_processes_split_a_trace_and_keep_its_times(tmp_path) -> None:
    rows = read_trace(_jsonl(tmp_path, MOONCAKE))
    shape = RequestShape(trace=rows)

    def mine(process: int, **kw) -> list:
        return list(
            my_requests(
                ProcessPlan(
                    process=process, processes=2, target="x", shape=shape, requests=None, **kw
                )
            )
        )

    assert mine(0) == [(0, 0.0), (2, 0.12)] and mine(1) == [(1, 0.05), (3, 2.0)]
    assert mine(1, duration_s=1.0) == [(1, 0.05)]


def test_each_turn_sends_the_history_and_a_new_message() -> None:
    shape = RequestShape(
        conversation=Conversation(2, 3),
        prompt_tokens=(5, 9),
        max_tokens=(4, 6),
        session_header="x-session",
        seed=3,
    )
    turns = [shape.request(i) for i in range(3)]
    assert [t.turn for t in turns] == [1, 2, 3]
    for earlier, later in itertools.pairwise(turns):
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
        assert len(later.parts) == len(earlier.parts) + 2
        assert sum(later.parts) == len(later.prompt_token_ids)
    assert turns[1].parts[1] == turns[0].max_tokens  # the answer stands in at its length
    assert {t.headers[0] for t in turns} == {("x-session", "session-0")}
    assert shape.request(3).headers == [("x-session", "session-1")]
    assert shape.request(3).prompt_token_ids[:5] != turns[0].prompt_token_ids[:5]


def test_the_chat_endpoint_sends_a_turn_as_messages() -> None:
    from cadence.lab.load.openai_http import OpenAITarget

    shape = RequestShape(conversation=Conversation(1, 2), prompt_tokens=(3, 3), max_tokens=(2, 2))
    body = msgspec.json.decode(
        build_body(OpenAITarget("http://x", "m", "chat"), shape.request(1), False)
    )
    assert [(m["role"], len(m["content"])) for m in body["messages"]] == [
        ("user", 3),
        ("assistant", 2),
        ("user", 3),
    ]
    completion = msgspec.json.decode(
        build_body(OpenAITarget("http://x", "m"), shape.request(1), False)
    )
    assert len(completion["prompt"]) == 8


def test_openai_usage_gives_the_cached_tokens() -> None:
    record = RequestRecord(request_id="r", process=0, start_ns=0, arrival_ns=[1, 2, 3])
    events = [
        b'data: {"choices": [{"text": "a"}]}',
        b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}',
        (
            b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2, '
            b'"prompt_tokens_details": {"cached_tokens": 32}}}'
        ),
    ]
    decode_events(record, events, False)
    assert record.cached_tokens == 32 and record.tokens == [1, 1]
    plain = RequestRecord(request_id="r", process=0, start_ns=0, arrival_ns=[1])
    decode_events(plain, events[:1], False)
    assert plain.cached_tokens == -1


def _record(
    n: int,
    start_ms: float,
    first_ms: float,
    scheduled_ms: float = 0.0,
    turn: int = 0,
    cached: int = -1,
) -> RequestRecord:
    return RequestRecord(
        request_id=str(n),
        process=0,
        start_ns=int(start_ms * 1e6),
        end_ns=int((first_ms + 2) * 1e6),
        prompt_tokens=100,
        max_tokens=2,
        arrival_ns=[int(first_ms * 1e6), int((first_ms + 2) * 1e6)],
        tokens=[1, 1],
        index=[0, 1],
        finish_reason=1,
        scheduled_ns=int(scheduled_ms * 1e6),
        turn=turn,
        cached_tokens=cached,
    )


def test_latencies_from_the_schedule_count_the_dispatch_delay() -> None:
    # The second request went 30 ms late: its TTFT hides that, the one from the schedule not.
    stats = summarize([_record(0, 10, 15, scheduled_ms=10), _record(1, 50, 55, scheduled_ms=20)])
    assert stats.ttft_ms.max == pytest.approx(5)
    assert stats.ttft_from_schedule_ms.max == pytest.approx(35)
    assert stats.e2e_from_schedule_ms.max == pytest.approx(37)
    closed = summarize([_record(0, 10, 15)])
    assert not closed.ttft_from_schedule_ms and not closed.ttft_by_turn_ms


def test_ttft_by_turn_and_cached_tokens() -> None:
    stats = summarize(
        [
            _record(0, 0, 9, turn=1, cached=0),
            _record(1, 0, 3, turn=2, cached=90),
            _record(2, 0, 4, turn=2),
            _record(3, 0, 10, turn=1, cached=0),
        ]
    )
    assert {t: d.p50 for t, d in stats.ttft_by_turn_ms.items()} == {"1": 9.5, "2": 3.5}
    assert stats.cached_tokens.requests == 3
    assert stats.cached_tokens.share_of_prompt == pytest.approx(0.3)
    assert stats.cached_tokens.per_request.max == 90


def test_p999_lies_between_p99_and_the_max() -> None:
    stats = summarize([_record(n, 0, 1 + n / 100) for n in range(2000)])
    d = stats.ttft_ms
    assert d.p99 < d.p999 < d.max and math.isclose(d.p999, 1 + 0.999 * 1999 / 100)


def test_new_record_fields_are_left_out_while_they_hold_their_defaults() -> None:
    plain = RequestRecord(request_id="r", process=0, start_ns=1)
    scheduled = RequestRecord(
        request_id="r", process=0, start_ns=1, trace_id="ab", scheduled_ns=5, turn=2
    )
    written = to_builtins(BenchResult(records=[plain, scheduled]))["records"]
    assert len(written[0]) == RequestRecord.__struct_fields__.index("trace_id")
    assert written[1][-2:] == [5, 2]
    back = msgspec.convert(json.loads(json.dumps(written)), list[RequestRecord])
    assert back == [plain, scheduled]


def test_a_session_header_and_the_history_reach_an_http_server() -> None:
    import asyncio

    from aiohttp import web

    from cadence.lab.load.openai_http import OpenAITarget, client_session, one_openai

    shape = RequestShape(
        conversation=Conversation(1, 2),
        prompt_tokens=(3, 3),
        max_tokens=(2, 2),
        session_header="x-session",
    )
    seen = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers.get("x-session"), await request.json()))
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(
            b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": "length"}]}\n\n'
        )
        await response.write(
            b'data: {"choices": [], "usage": {"completion_tokens": 1, '
            b'"prompt_tokens_details": {"cached_tokens": 5}}}\n\ndata: [DONE]\n\n'
        )
        return response

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        target = OpenAITarget(f"http://127.0.0.1:{port}", "m", "chat")
        client = client_session(target)
        try:
            record, events = await one_openai(target, client, shape.request(1), 0, False, 5.0)
        finally:
            await client.close()
            await runner.cleanup()
        decode_events(record, events, False)
        return record

    record = asyncio.run(main())
    assert record.code == "OK" and record.cached_tokens == 5 and record.tokens == [1]
    [(session, body)] = seen
    assert session == "session-0"
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]


def test_repeats_give_each_figure_its_mean_and_interval() -> None:
    from cadence.lab.analysis.noise import repeats, spread

    f = spread([1.0, 2.0, 3.0])
    assert (f.mean, f.stdev) == (2.0, 1.0)
    assert (f.ci95_low, f.ci95_high) == pytest.approx((2 - 4.303 / 3**0.5, 2 + 4.303 / 3**0.5))
    assert math.isnan(spread([5.0]).ci95_low)
    runs = [summarize([_record(0, 0, ttft)]) for ttft in (10, 11, 12)]
    got = repeats([BenchResult(**msgspec.structs.asdict(r)) for r in runs])
    assert got.runs == 3 and got.figures["ttft_p99_ms"].values == [10, 11, 12]


def _repeated(ttft_p99: list[float]) -> BenchResult:
    from cadence.lab.analysis.noise import spread
    from cadence.lab.results import Distribution, Repeats

    result = BenchResult(ttft_ms=Distribution(count=1, p99=ttft_p99[0]))
    result.repeats = Repeats(runs=len(ttft_p99), figures={"ttft_p99_ms": spread(ttft_p99)})
    return result


def test_a_regression_is_judged_only_outside_the_noise(capsys) -> None:
    from cadence.lab.report.compare import parse_gate
    from cadence.lab.report_cli import _judge

    gate = parse_gate("ttft_p99_ms>1.05x")
    base = _repeated([10.0, 11.0, 12.0])
    noisy = _repeated([11.0, 12.0, 13.0])  # mean 12 > 11.55, the intervals overlap
    assert gate.judge(base, noisy, "b.json").endswith("within noise")
    assert gate.failure(base, noisy, "b.json") is None
    _judge([gate], [base, noisy], ["a.json", "b.json"])  # passes: no exit
    assert "b.json: ttft_p99_ms>1.05x: ttft_p99_ms mean 12" in capsys.readouterr().out
    worse = _repeated([20.0, 21.0, 22.0])
    assert "failed: ttft_p99_ms mean 21" in gate.failure(base, worse, "c.json")
    with pytest.raises(SystemExit):
        _judge([gate], [base, worse], ["a.json", "c.json"])
    # One run each: judged on the values, as before.
    single = BenchResult(ttft_ms=msgspec.structs.replace(base.ttft_ms, p99=12.0))
    assert "failed" in gate.failure(BenchResult(ttft_ms=base.ttft_ms), single, "d.json")


def test_requests_export_as_jsonl_and_csv(tmp_path) -> None:
    import csv

    from cadence.lab.report.export import COLUMNS, write

    records = [
        _record(0, 10, 15, scheduled_ms=8, turn=1, cached=4),
        RequestRecord(
            request_id="x", process=0, start_ns=int(20e6), code="UNAVAILABLE", error="gone"
        ),
    ]
    assert write(str(tmp_path / "r.jsonl"), records) == 2
    first, failed = (json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines())
    assert list(first) == list(COLUMNS)
    assert (
        first["dispatch_delay_ms"],
        first["ttft_ms"],
        first["ttft_from_schedule_ms"],
        first["cached_tokens"],
        first["turn"],
    ) == (2.0, 5.0, 7.0, 4, 1)
    assert (failed["ttft_ms"], failed["code"], failed["sent_s"]) == (None, "UNAVAILABLE", 0.01)
    write(str(tmp_path / "r.csv"), records)
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert rows[0]["ttft_ms"] == "5.0" and rows[1]["ttft_ms"] == "" and rows[1]["error"] == "gone"
    # Parquet: the same rows, each column typed even where every row is empty.
    pq = pytest.importorskip("pyarrow.parquet")
    assert write(str(tmp_path / "r.parquet"), records) == 2
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.column_names == list(COLUMNS)
    assert table.to_pylist() == [first, failed]
    assert str(table.schema.field("connect_ms").type) == "double"


def test_an_export_that_cannot_be_written_is_refused_before_the_run(monkeypatch) -> None:
    import sys

    from cadence.lab.report.export import ExportError, check

    check("r.csv")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as where pyarrow is not installed
    with pytest.raises(ExportError, match=r"pip install 'cadence\[parquet\]'"):
        check("r.parquet")


def test_a_tokenizer_counts_another_servers_output_in_its_tokens(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from cadence.lab.load.openai_http import token_counter

    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    count = token_counter(str(tmp_path))
    record = RequestRecord(request_id="r", process=0, start_ns=0, arrival_ns=[1, 2, 3])
    events = [
        b'data: {"choices": [{"text": "hello wor"}]}',
        b'data: {"choices": [{"text": "ld hello hello world"}]}',
        b'data: {"choices": [], "usage": {"completion_tokens": 2}}',
    ]
    decode_events(record, events, False, count)
    assert record.tokens == [3, 2] and record.index == [0, 3]  # 5 words, not 2 events
    with pytest.raises(ValueError, match="cannot read"):
        token_counter(str(tmp_path / "nowhere"))


def test_length_distributions_draw_what_they_say(tmp_path) -> None:
    import statistics

    from cadence.lab.load.lengths import parse_lengths

    def drawn(text: str, field: str = "max_tokens") -> list[int]:
        lengths = parse_lengths(text)
        shape = RequestShape(output_lengths=lengths, prompt_lengths=lengths, seed=2)
        plans = [shape.request(i) for i in range(4000)]
        return [p.max_tokens if field == "max_tokens" else len(p.prompt_token_ids) for p in plans]

    lognormal = drawn("lognormal:200,80")
    assert statistics.fmean(lognormal) == pytest.approx(200, rel=0.05)
    assert statistics.pstdev(lognormal) == pytest.approx(80, rel=0.1)
    assert statistics.median(lognormal) < statistics.fmean(lognormal)  # the right tail
    normal = drawn("normal:50,30,10,60", field="prompt")
    assert min(normal) == 10 and max(normal) == 60
    assert statistics.fmean(drawn("normal:50,5")) == pytest.approx(50, rel=0.02)
    (tmp_path / "lengths.txt").write_text("3\n3\n90\n")
    empirical = drawn(f"empirical:{tmp_path / 'lengths.txt'}")
    assert set(empirical) == {3, 90} and empirical.count(3) > empirical.count(90)
    assert parse_lengths(f"empirical:{tmp_path / 'lengths.txt'}").bounds == (3, 90)
    for bad, said in (
        ("normal:5", "expected N, LO:HI"),
        ("lognormal:0,1", "MEAN > 0"),
        ("empirical:/nowhere", "cannot read /nowhere"),
    ):
        with pytest.raises(ValueError, match=said):
            parse_lengths(bad)


def test_client_populations_take_their_shares_and_keep_them() -> None:
    from collections import Counter

    from cadence.lab.load.plan import ClientMix

    mix = ClientMix(read_delay=(30.0, 0.25), cancel=(200.0, 0.1), deadline=(500.0, 0.2))
    shape = RequestShape(clients=mix, seed=4)
    plans = [shape.request(i) for i in range(4000)]
    shares = {k: v / 4000 for k, v in Counter(p.population for p in plans).items()}
    assert shares == pytest.approx(
        {"slow_reader": 0.25, "cancelling": 0.1, "deadline": 0.2, "plain": 0.45}, abs=0.03
    )
    slow = next(p for p in plans if p.population == "slow_reader")
    assert (slow.read_delay_s, slow.cancel_s, slow.deadline_s) == (0.03, 0.0, 0.0)
    assert next(p for p in plans if p.population == "cancelling").cancel_s == 0.2
    assert next(p for p in plans if p.population == "deadline").deadline_s == 0.5
    assert plans == [shape.request(i) for i in range(4000)]


def test_rate_stages_and_ramps_shape_the_arrivals() -> None:
    import itertools

    from cadence.lab.load.plan import poisson_offsets

    steps = list(poisson_offsets(1.0, 3, [(40.0, 40.0, 5.0), (200.0, 200.0, 5.0)]))
    assert sum(1 for t in steps if t < 5) == pytest.approx(200, rel=0.2)
    assert sum(1 for t in steps if t >= 5) == pytest.approx(1000, rel=0.1)
    assert steps[-1] < 10  # the run ends with its last stage
    ramp = list(
        itertools.takewhile(
            lambda t: t < 20,
            poisson_offsets(1.0, 3, [(10.0, 190.0, 10.0), (190.0, 190.0, math.inf)]),
        )
    )
    per_second = [sum(1 for t in ramp if k <= t < k + 1) for k in range(20)]
    assert sum(per_second[:5]) == pytest.approx(sum(10 + 18 * (k + 0.5) for k in range(5)), rel=0.2)
    assert sum(per_second[10:]) == pytest.approx(1900, rel=0.1)
    plan = ProcessPlan(
        process=0,
        target="x",
        shape=RequestShape(seed=3),
        requests=None,
        rate=200.0,
        stages=[(40.0, 40.0, 5.0), (200.0, 200.0, 5.0)],
    )
    assert [offset for _, offset in my_requests(plan)] == steps


def test_the_saturation_watch_stops_where_ttft_leaves_its_floor() -> None:
    """A ramp from 10 to 50 requests/s over 4 s on a server that ends at most 20/s: the
    windows before the knee pass, two past it end the run, the knee is at the offered 20."""
    import math

    from cadence.lab.load.saturation import SaturationWatch, offered_between

    stages = [(10.0, 50.0, 4.0), (50.0, 50.0, math.inf)]
    assert offered_between(stages, 0, 4) == pytest.approx(120)
    assert offered_between(stages, 4, 5) == pytest.approx(50)
    watch = SaturationWatch(0.5, stages)
    backlog = 0.0
    for k in range(16):
        a = k * 0.5
        offered = offered_between(stages, a, a + 0.5)
        served = min(offered + backlog, 10.0)  # 20/s
        backlog += offered - served
        for n in range(round(served)):  # TTFT: 20 ms, plus the queue's wait
            watch.ended(a + (n + 0.5) * 0.5 / round(served), 20 + backlog / 20 * 1e3)
        if watch.stop(a + 0.5):
            break
    seen = watch.result
    assert seen.stopped and seen.stopped_at_s <= 3.0
    assert 17 <= seen.knee_rate_per_s <= 26
    assert [w[0] for w in seen.windows] == [k * 0.5 for k in range(len(seen.windows))]

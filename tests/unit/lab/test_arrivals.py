"""New requests that hold the streams already running (`arrivals_stall_streams`), read from the
client's sends and reads alone: named where the slow gaps hold the sends beyond chance, never
for slow gaps elsewhere, and never for reads the lab's own client stamped late."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.verdict import judge
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult, Client
from tests.unit.lab.test_coincidence import MS, STEP, US, as_bench, record

SENDS = [(97 * (j + 1) + 3) * MS for j in range(12)]
"""Twelve instants of the run at which two new requests are sent each."""
HOLD_MS = 12


def running(held_at: list[int], hold_ms: int = HOLD_MS) -> list[RequestRecord]:
    """Sixteen streams of 150 tokens, a token every 10 ms; at each instant of `held_at`, half
    of them (in turn) get their next token `hold_ms` late, and so every later one. Two short
    requests are sent at each instant of SENDS; each streams 8 tokens 10 ms apart, from 45 ms
    after its send."""
    records = []
    for k in range(16):
        shift, arrivals, last = 0, [], k * 30 * US
        for i in range(150):
            due = (i + 1) * STEP + k * 30 * US + shift
            for j, at in enumerate(held_at):
                if last < at <= due and (j + k) % 2 == 0:
                    shift += hold_ms * MS
                    due += hold_ms * MS
            arrivals.append(due)
            last = due
        records.append(record(k, k * 20 * US, arrivals))
    for j, at in enumerate(SENDS):
        for n in range(2):
            first = at + 45 * MS + n * 50 * US  # well after the hold: no prefill in it
            records.append(record(100 + 2 * j + n, at, [first + i * STEP for i in range(8)]))
    return records


def rules(result: BenchResult) -> dict[str, dict]:
    result.diagnosis = diagnose(result)
    return {f.rule: f.evidence for f in result.diagnosis}


def test_streams_held_as_new_requests_arrive_are_the_arrivals() -> None:
    result = as_bench(running(SENDS))
    found = rules(result)
    assert set(found) == {"arrivals_stall_streams"}, found
    arrivals = found["arrivals_stall_streams"]
    assert arrivals["slow_gaps_holding_a_send"] >= 0.9 * arrivals["slow_gaps_judged"]
    assert arrivals["slow_gaps_holding_a_send_by_chance"] < arrivals["slow_gaps_judged"] / 3
    assert arrivals["itl_tail_share"] > 0.9
    verdict, unexplained = judge(result)
    assert verdict.state == "unhealthy" and not unexplained


def test_sends_into_streams_that_keep_their_pace_are_nothing() -> None:
    result = as_bench(running([]))
    assert rules(result) == {}
    assert judge(result)[0].state == "healthy"


def test_slow_gaps_at_other_instants_are_not_the_arrivals() -> None:
    """The same holds, 45 ms after each send: a cause of its own, not the arrivals."""
    result = as_bench(running([at + 45 * MS for at in SENDS]))
    assert "arrivals_stall_streams" not in rules(result)


def test_reads_the_clients_loop_stamped_late_as_it_sent_are_the_clients() -> None:
    """The lab's own client made its sends and, meanwhile, read late: its loop ran late from
    each send until past the held reads. The slow gaps are the client's, not the arrivals'."""
    result = as_bench(running(SENDS))
    result.client = Client(loop_stalls=[(0, at, at + (HOLD_MS + 12) * MS) for at in SENDS])
    found = rules(result)
    assert "client_read_late" in found and "arrivals_stall_streams" not in found, found

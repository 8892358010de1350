"""The lab's own client reading late: its load loop's ticks (`LoopLateness`) and the rule that
puts the slow reads it stamped late on the client (`client_read_late`), not the server."""

from __future__ import annotations

import asyncio
import time

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.verdict import judge
from cadence.lab.load.loop_lateness import LoopLateness
from cadence.lab.records import RequestRecord
from cadence.lab.results import BenchResult, Client
from tests.unit.lab.test_coincidence import MS, US, as_bench, batched

STALL_MS = 30


def test_a_loop_held_up_is_a_stall_as_long_as_it_was_held() -> None:
    async def held() -> LoopLateness:
        ticks = LoopLateness().start()
        await asyncio.sleep(0.02)
        time.sleep(STALL_MS / 1e3)  # noqa: ASYNC251 (the loop held up, as a wave of sends does)
        await asyncio.sleep(0.02)
        await ticks.stop()
        return ticks

    ticks = asyncio.run(held())
    assert len(ticks.late_ms) >= 4
    start, end = max(ticks.stalls, key=lambda s: s[1] - s[0])
    assert STALL_MS - 6 <= (end - start) / MS <= STALL_MS + 20
    assert max(ticks.late_ms) >= STALL_MS - 6


def client_stalled(
    records: list[RequestRecord], at: list[int], process: int = 0, moved: bool = True
) -> BenchResult:
    """`records` read by a client whose loop stalled STALL_MS from each instant of `at`:
    every read due in a stall is stamped as it ends, one after another (`moved`; else the
    stalls held no read)."""
    stalls = [(process, a, a + STALL_MS * MS) for a in at]
    if moved:
        for r in records:
            late = []
            for t in r.arrival_ns:
                end = next((b for _, a, b in stalls if a <= t < b), None)
                late.append(t if end is None else end + (int(r.request_id[6:]) + 1) * 30 * US)
            r.arrival_ns, r.end_ns = late, late[-1]
    result = as_bench(records)
    result.client = Client(loop_stalls=stalls)
    return result


AT = [k * 103 * MS for k in (1, 2, 3, 4, 5)]
"""Five stalls of the client's loop, off the engine's 10 ms steps."""


def test_slow_reads_the_clients_loop_stamped_late_are_the_clients() -> None:
    result = client_stalled(batched(), AT)
    result.diagnosis = diagnose(result)
    found = {f.rule: f for f in result.diagnosis}
    assert set(found) == {"client_read_late"}, found
    late = found["client_read_late"]
    assert late.evidence["client_loop_stalls"] == 5
    assert late.evidence["itl_tail_share"] > 0.9
    verdict, unexplained = judge(result)
    itl = next(t for t in verdict.tails if t.metric == "itl_ms")
    assert itl.state == "bad" and itl.explained_by["client_read_late"] > 0.9
    assert not unexplained
    # The tail says nothing of the server: the run cannot judge it, and says whose it is.
    assert verdict.state == "inconclusive", verdict.line
    assert "the lab's own client's, not the server's: client_read_late" in verdict.line


def test_a_tail_the_client_explains_beside_a_server_cause_is_unhealthy() -> None:
    """The client's late reads and the server's own pause each make part of the tail: the
    server's part is enough for the run to be unhealthy."""
    records = batched(tokens=80, pauses=(10, 30, 50, 70), pause_ms=80)
    result = client_stalled(records, [k * 97 * MS + 3 * MS for k in (1, 3, 5)])
    result.diagnosis = diagnose(result)
    verdict, _ = judge(result)
    assert verdict.state == "unhealthy", verdict.line


def test_the_servers_own_stall_is_not_the_clients() -> None:
    """Every stream paused 80 ms by the server at four steps, while the client's loop ran
    late at other instants: the stall is the server's, and the client is not named."""
    records = batched(tokens=80, pauses=(10, 30, 50, 70), pause_ms=80)
    result = client_stalled(records, [k * 97 * MS + 3 * MS for k in (1, 3)], moved=False)
    found = {f.rule for f in diagnose(result)}
    assert "client_read_late" not in found
    assert "streams_stall_together" in found


def test_stalls_of_another_load_process_hold_none_of_these_reads() -> None:
    records = batched()
    result = client_stalled(records, AT)
    result.client = Client(loop_stalls=[(1, a, b) for _, a, b in result.client.loop_stalls])
    assert "client_read_late" not in {f.rule for f in diagnose(result)}


def test_a_stall_or_two_in_a_healthy_tail_is_no_finding() -> None:
    result = client_stalled(batched(tokens=150), AT[:1])  # 16 slow reads of 2,384
    result.diagnosis = diagnose(result)
    assert judge(result)[0].state == "healthy"
    assert "client_read_late" not in {f.rule for f in result.diagnosis}

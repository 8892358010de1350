"""`server_threads_wait_for_cpu` on a host with no core to spare, whoever filled it: the
server's threads waited for a CPU and a tail the verdict judges is bad. Built by hand as a
2-core host running a cadence server of two CPU workers and the load's client would record
it: streams stepped together every 10 ms with cadence's timing, a few steps slow."""

from __future__ import annotations

import msgspec

from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.verdict import judge
from cadence.lab.results import (
    BenchResult,
    Distribution,
    HostCpu,
    ProcessCpu,
    ServerThreads,
    System,
)
from tests.unit.lab.test_coincidence import as_bench, timed

RULE = "server_threads_wait_for_cpu"
SLOW = dict.fromkeys((20, 50, 80, 110, 140), 15)
"""Five steps 15 ms slow (of 150): a bad ITL tail."""

WORKER = '/venv/bin/python -m cadence.worker {"index":%d,"device":"cpu","input_address":"ipc://x"'


def on_host(
    result: BenchResult,
    busy: float = 190.0,
    client: float = 40.0,
    others: float = 0.0,
    waited: float = 80.0,
    step_wait: float = 30.0,
    named: bool = True,
) -> BenchResult:
    """`result` on a 2-core host `busy` % of a core (the load's client `client` of it, other
    work `others`, the server the rest but for the lab's 2), the server's threads waiting `waited` % of a core
    for a CPU, each worker's busiest thread `step_wait` % of the run. `named`: the lab named
    the workers' processes (a gRPC front; an HTTP front's lab names the front "server" only)."""
    wall = result.wall_s
    ticks = [0.1 * i for i in range(1, int(wall * 10) + 4)]
    server = busy - client - others - 2.0

    def sampled(pct: float, pid: int) -> ProcessCpu:
        return ProcessCpu(pid=pid, samples=[(t, pct) for t in ticks])

    processes = (
        {
            "front": sampled(server * 0.2, 10),
            "worker0": sampled(server * 0.4, 11),
            "worker1": sampled(server * 0.4, 12),
        }
        if named
        else {"server": sampled(server * 0.2, 10)}
    )
    result.system = System(
        processes={**processes, "client0": sampled(client, 20)},
        host=HostCpu(
            cpus=2,
            samples=[(t, busy, 2.0) for t in ticks],
            wakeups=Distribution(count=500, p50=0.05, p90=0.1, p99=0.3, max=1.0),
        ),
    )
    step = {"python": True, "threads": 6, "cpu_pct": 55.0, "busiest_thread": "python"}
    step.update(busiest_thread_cpu_pct=50.0, busiest_thread_wait_pct=step_wait)
    result.server_threads = msgspec.convert(
        {
            "wall_s": wall,
            "cpus": 2,
            "threads": 20,
            "processes": [
                {
                    "pid": 10,
                    "command": "/venv/bin/python -m cadence.cli serve --port 1",
                    "cpu_pct": 25.0,
                    "busiest_thread": "python",
                    "busiest_thread_cpu_pct": 20.0,
                    "busiest_thread_wait_pct": 10.0,
                },
                dict(step, pid=11, command=WORKER % 0),
                dict(step, pid=12, command=WORKER % 1),
            ],
            "groups": [
                {"name": "python", "threads": 12, "cpu_pct": 130.0, "wait_for_cpu_pct": waited}
            ],
        },
        ServerThreads,
    )
    return result


def run(slow: dict[int, int] | None = SLOW, **host) -> BenchResult:
    result = on_host(as_bench(timed(slow_steps=slow, worker_step_ms={0: 10, 1: 10})), **host)
    result.diagnosis = diagnose(result)
    return result


def rules(result: BenchResult) -> set[str]:
    return {f.rule for f in result.diagnosis if f.alarm}


def test_a_full_host_whose_waits_made_a_bad_tail_is_named_with_who_filled_it() -> None:
    """The load's client took the last core: no other work (`host_contended` is silent), the
    server's threads waited 0.8 cores' worth, ITL's tail is bad. The finding names the client's
    cores and the workers' step threads' waits, and explains the tail with no share."""
    result = run()
    assert rules(result) == {RULE}, rules(result)
    [found] = [f for f in result.diagnosis if f.rule == RULE]
    assert found.evidence["client_cores"] == 0.4 and found.evidence["others_cores"] < 0.5
    assert found.evidence["waited_cores"] == 0.8 and found.evidence["bad_tails"] == "itl_ms"
    assert found.evidence["worker0_busiest_thread_wait_pct"] == 30.0
    assert (
        "the load's client 0.40" in found.finding and "worker 1's busiest thread" in found.finding
    )
    assert "taskset" in found.look_at and "--devices" in found.look_at
    verdict, unexplained = judge(result)
    itl = next(t for t in verdict.tails if t.metric == "itl_ms")
    assert itl.state == "bad" and itl.explained_by == {RULE: None} and not unexplained
    # An HTTP front's run names the workers from their command lines all the same.
    # The result, finding and all, reads back as written (evidence holds scalars only).
    assert msgspec.convert(msgspec.to_builtins(result), BenchResult).diagnosis == result.diagnosis
    sse = run(named=False)
    [found] = [f for f in sse.diagnosis if f.rule == RULE]
    assert rules(sse) == {RULE} and "worker1_busiest_thread_wait_pct" in found.evidence


def test_silent_on_a_healthy_tail() -> None:
    """The same full host and waits, no slow steps: the tail is within its bound."""
    result = run(slow=None)
    assert judge(result)[0].state == "healthy" and not rules(result)


def test_silent_with_a_core_to_spare_or_waits_too_small() -> None:
    """A host with a core to spare (the waits are the odd wake-up), or waits under a quarter
    of a core: the slow steps stay the engine's."""
    assert rules(run(busy=120.0, client=20.0)) == {"itl_unstable_engine"}
    assert rules(run(waited=15.0)) == {"itl_unstable_engine"}


def test_other_work_that_filled_the_host_is_the_hosts_finding() -> None:
    """Other work took most of a core: `host_contended` names it, the waits' finding gives way
    to it, and the engine's slow steps are read against the host as before (steps slower
    than the host's wake-ups stay the engine's)."""
    found = rules(run(busy=198.0, client=5.0, others=56.0))
    assert RULE not in found and "host_contended" in found, found
    assert "itl_unstable_engine" in found


def test_the_engine_gives_way_only_where_its_step_threads_waited_for_the_slow_steps() -> None:
    """The workers' step threads waited 2% of the run, less than the slow steps took beyond
    the typical step: the steps are the engine's own, named beside the full host's waits."""
    assert rules(run(step_wait=2.0)) == {RULE, "itl_unstable_engine"}
    assert "itl_unstable_engine" not in rules(run(step_wait=30.0))


def test_waits_of_a_saturated_server_whose_tails_held_are_information() -> None:
    """The server's threads waited more than a core's worth (more threads ready than cores)
    but every tail stayed within its bound: said, with no alarm; with a bad tail, an alarm."""
    healthy = run(slow=None, busy=200.0, client=10.0, waited=150.0)
    [found] = [f for f in healthy.diagnosis if f.rule == RULE]
    assert not found.alarm and "within its bound" in found.finding
    assert judge(healthy)[0].state == "healthy"
    bad = run(busy=200.0, client=10.0, waited=150.0)
    assert any(f.rule == RULE and f.alarm for f in bad.diagnosis)

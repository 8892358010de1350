"""Rules on the gaps between tokens: `itl_unstable_engine` and `itl_unstable_network_side`
(uneven inter-token latency, put on the engine's steps or on the way to the client) and
`slow_reader` (clients that receive slower than the engine makes tokens)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.coincidence import attribution, recognised
from cadence.lab.analysis.diagnosis.facts import RunFacts, finite, rounded, steps_vary, usable
from cadence.lab.analysis.diagnosis.names import (
    RULE_FRONT_LOOP_BLOCKED,
    RULE_HOST_CONTENDED,
    RULE_ITL_UNSTABLE_ENGINE,
    RULE_ITL_UNSTABLE_NETWORK,
    RULE_SERVER_THREADS_WAIT_FOR_CPU,
    RULE_SLOW_READER,
    RULE_SLOW_WORKER,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.diagnosis.signatures import HostDelays, SlowSteps, StepsWaitedForCpu
from cadence.lab.analysis.diagnosis.threads import step_thread_waits_ms
from cadence.lab.analysis.noise_floor import HOPS, noise_floor
from cadence.lab.analysis.tail_bound import UNEXPLAINED_MIN_SHARE, itl_tail_within_bound
from cadence.lab.results import Distribution, Finding

ITL_UNEVEN_P90_RATIO = 1.3
"""ITL is uneven from this p90/p50 (idle steady runs: 1.1-1.2); the engine rule needs no
more, because the engine's own steps must vary as well (`facts.steps_vary`), which a busy
machine does not fake. Jitter with a standard deviation of 80 % of the step gives 1.75-2.7
(the low end when a busy machine also stretches the p50). The rules read the p90, not the
p99: in a short run one stall of a process (100 ms when two benchmarks share 2 cores) delays
every open stream's gap at once, 16 of 800 gaps, and moves the p99 alone."""

NETWORK_UNSTABLE_P90_RATIO = 2.5
"""ITL p90/p50 from which variation on the way to the client counts as a finding. Steady
runs show 1.1-1.3 on an idle 2-core machine, but CPU contention alone (another benchmark on
the same cores delaying the front and the client) reaches 1.9: below 2.5 uneven delivery is
not told apart from a busy machine."""

ITL_MIN_SPREAD_MS = 3.0
"""...and ITL p90 - p50 is at least this many ms: sub-millisecond gaps double on noise."""

SIDE_SHARE = 0.4
"""Variation is put on the path from the step to the client when that path holds at least
this share of the combined spread (p90 - p50 of token_delay_ms plus that of engine_step)."""

ENGINE_SIDE_SHARE = 0.25
"""...and on the engine, whose steps must vary themselves, from this share: jitter gives the
engine 0.5-0.9 of the spread even on a busy machine, where late deliveries add to the other
side. Both sides are named when both hold."""

SLOW_READER_ITL_FACTOR = 2.0
"""Clients receive tokens slower than the engine makes them when ITL p50 is this many
engine steps (p50). A client keeping up receives one token per step: ITL p50 is 1.0-1.1
steps on an idle machine and up to 1.6 with another benchmark on the same 2 cores (late
wake-ups between steps, which the engine_step segment does not hold); a client that sleeps
30 ms per chunk against 5 ms steps gives 6."""

SLOW_READER_PATH_SHARE = 0.5
"""...and the backlog is on the network side when buffer + send hold at least this share
of a token's path from step start to client (about 0.2 when clients keep up)."""

MERGED_CHUNK_TOKENS = 1.5
"""Chunks hold this many tokens on average when merging is in effect: a client that keeps
up gets one token per chunk (the odd merged chunk under noise moves the mean by < 0.2)."""

MERGE_BUFFER_STEPS = 1.0
"""...with a chunk's first token waiting in the front's buffer at least this many engine
steps (p50): the sender was still busy with the previous chunk (flow control)."""


def itl_uneven(facts: RunFacts, ratio: float) -> bool:
    itl = facts.itl
    if not itl or itl.p50 <= 0:
        return False
    return itl.p90 >= ratio * itl.p50 and itl.p90 - itl.p50 >= ITL_MIN_SPREAD_MS


class _Spread:
    """How ITL's spread splits between the engine's steps and the path to the client."""

    def __init__(self, itl: Distribution, step: Distribution, delay: Distribution) -> None:
        self.itl, self.step = itl, step
        self.engine = max(0.0, step.p90 - step.p50)
        self.path = max(0.0, delay.p90 - delay.p50)
        self.total = self.engine + self.path
        self.evidence = {
            "itl_p50_ms": rounded(itl.p50),
            "itl_p90_ms": rounded(itl.p90),
            "itl_p99_ms": rounded(itl.p99),
            "engine_step_p50_ms": rounded(step.p50),
            "engine_step_p90_ms": rounded(step.p90),
            "token_delay_p50_ms": rounded(delay.p50),
            "token_delay_p90_ms": rounded(delay.p90),
            "engine_share_of_spread": rounded(self.engine / self.total, 3) if self.total else 0.0,
        }


def _spread(facts: RunFacts) -> _Spread | None:
    """The split, when ITL is uneven and there is a spread to split; else None."""
    itl, step, delay = facts.itl, facts.step, facts.delay
    if not (
        itl and step and delay and facts.typical_step and itl_uneven(facts, ITL_UNEVEN_P90_RATIO)
    ):
        return None
    spread = _Spread(itl, step, delay)
    return spread if spread.total > 0 else None


ENGINE_TAIL_SHARE = 0.25
"""The engine's own slow steps are named, from the gaps they coincide with (`SlowSteps`), when
they explain at least this share of the gaps' tail time: a p99 a few slow steps make, which
the p90 test above does not see. Only of a tail the verdict calls bad (ITL p99 over the run's
bound, `tail_bound`): a few steps a wake-up or two late make most of a healthy run's small
tail, and are no finding."""

_ENGINE_LOOK_AT = (
    "the engine's step time: batch composition (prefill in decode steps), "
    "host-side work in the step, other jobs on the card, clock throttling, "
    "or a host CPU too busy to run the worker on time"
)


def unstable_engine(facts: RunFacts) -> list[Finding]:
    tail = attribution(facts)
    shares = tail.shares(RULE_ITL_UNSTABLE_ENGINE) if tail else {}
    spread = _spread(facts)
    if (
        spread
        and spread.engine >= ENGINE_SIDE_SHARE * spread.total
        and steps_vary(spread.step.p50, spread.step.p90)
    ):
        itl, step = spread.itl, spread.step
        return [
            Finding(
                rule=RULE_ITL_UNSTABLE_ENGINE,
                finding=(
                    f"ITL is unstable (p90 {itl.p90:.1f} ms vs p50 {itl.p50:.1f} ms) "
                    f"and the engine's steps vary as much (p90 {step.p90:.1f} ms vs p50 "
                    f"{step.p50:.1f} ms): the engine jitters, not the serving layer"
                ),
                evidence={**spread.evidence, **shares},
                look_at=_ENGINE_LOOK_AT,
            )
        ]
    found = recognised(facts, SlowSteps, ENGINE_TAIL_SHARE)
    if found is None or itl_tail_within_bound(facts.result):
        return []
    tail, slow_steps = found
    ev = slow_steps.evidence
    share = tail.itl_share(RULE_ITL_UNSTABLE_ENGINE)
    return [
        Finding(
            rule=RULE_ITL_UNSTABLE_ENGINE,
            finding=(
                f"the slow gaps fall on slow steps of the engine's own: "
                f"{ev['slow_gaps_on_slow_steps']} of {ev['slow_gaps']} slow gaps came from "
                f"steps {ev['engine_gap_at_those_p50_ms']:.1f} ms apart at the median (max "
                f"{ev['engine_gap_at_those_max_ms']:.1f}) where the engine's gap is "
                f"{ev['engine_gap_p50_ms']:.1f} ms; the engine's steps explain {share:.0%} of "
                "the gaps' tail, not the serving layer"
            ),
            evidence={**ev, **shares},
            look_at=_ENGINE_LOOK_AT,
        )
    ]


def unstable_network_side(facts: RunFacts) -> list[Finding]:
    spread = _spread(facts)
    if spread is None:
        return []
    if not (
        spread.path >= SIDE_SHARE * spread.total and itl_uneven(facts, NETWORK_UNSTABLE_P90_RATIO)
    ):
        return []
    # The way to the client is where the run's noise floor lies (the front's and the
    # client's wake-ups, the client's read lag): a spread within it is the host's and the
    # lab's own, not the network side's.
    if spread.itl.p90 - spread.itl.p50 < noise_floor(facts.result).ms:
        return []
    spreads = {
        name: d.p90 - d.p50 for name in ("transfer", "buffer", "send") if (d := facts.segment(name))
    }
    worst = max(spreads, key=spreads.__getitem__) if spreads else "send"
    # The front's own event-loop lag (when the server exports it): a loop late by more than
    # 20 ms in many samples says the front itself is blocked or saturated.
    scraped = facts.result.system.server_metrics
    loop = scraped.front_loop if scraped else None
    loop_evidence = (
        {"front_loop_samples": loop.samples, "front_loop_late_over_20ms": loop.late_over_20ms}
        if loop and loop.samples
        else {}
    )
    return [
        Finding(
            rule=RULE_ITL_UNSTABLE_NETWORK,
            finding=(
                f"ITL is unstable (p90 {spread.itl.p90:.1f} ms vs p50 {spread.itl.p50:.1f} ms) "
                "and the extra time is on the way from the step to the client, mostly in "
                f"{worst}, not in the engine's steps"
            ),
            evidence={
                **spread.evidence,
                **{f"{n}_spread_ms": rounded(v) for n, v in spreads.items()},
                **loop_evidence,
            },
            look_at=(
                "backlog on the network side: slow clients, HTTP/2 flow control, a blocked "
                "front event loop (front CPU), the output reader falling behind"
            ),
        )
    ]


def slow_reader(facts: RunFacts) -> list[Finding]:
    itl, typical = facts.itl, facts.typical_step
    tokens = usable(facts.result.chunk_tokens)
    buffer = facts.segment("buffer")
    if not (itl and typical and tokens and buffer):
        return []
    path_share = sum(facts.share("token", n) or 0.0 for n in ("buffer", "send"))
    merging = tokens.mean >= MERGED_CHUNK_TOKENS and buffer.p50 >= MERGE_BUFFER_STEPS * typical
    lagging = itl.p50 >= SLOW_READER_ITL_FACTOR * typical and path_share >= SLOW_READER_PATH_SHARE
    if not (merging or lagging):
        return []
    evidence: dict = {
        "itl_p50_ms": rounded(itl.p50),
        "engine_step_p50_ms": rounded(typical),
        "chunk_tokens_mean": rounded(tokens.mean),
        "buffer_p50_ms": rounded(buffer.p50),
        "token_share_buffer_send": rounded(path_share, 3),
    }
    if facts.delay:
        evidence["token_delay_p50_ms"] = rounded(facts.delay.p50)
    scraped = facts.result.system.server_metrics
    for name in ("cadence_merged_steps_total", "cadence_buffer_overflows_total"):
        if scraped and finite(scraped.during_run.get(name)):
            evidence[name.removeprefix("cadence_")] = rounded(scraped.during_run[name], 0)
    if merging:
        finding = (
            f"tokens reach the clients slower than the engine makes them: chunks carry "
            f"{tokens.mean:.1f} tokens on average and a chunk's first token waits "
            f"{buffer.p50:.1f} ms in the front's buffer (merging is in effect)"
        )
    else:
        finding = (
            f"clients read slower than tokens come: a token every {itl.p50:.1f} ms "
            f"reaches them against an engine step of {typical:.1f} ms, and "
            f"{path_share:.0%} of a token's path is after the front (buffer + send)"
        )
    return [
        Finding(
            rule=RULE_SLOW_READER,
            finding=finding,
            evidence=evidence,
            look_at=(
                "the clients' read loop (work per chunk, --read-delay-ms), their CPU and "
                "network, or a front too busy to send (front_cpu_bound); --queue-capacity "
                "and --overflow decide whether the server merges tokens or ends the stream"
            ),
        )
    ]


def _engine_in_front(finding: Finding, facts: RunFacts) -> bool:
    """No worker processes: the engine's steps wait for the blocked front loop too."""
    return not facts.workers


def _late_by_the_host(
    finding: Finding, facts: RunFacts, slow: str, typical: str, hops: int, stat: str
) -> bool:
    """The finding's slow value (`slow` over `typical`, keys of its evidence) is no later
    than `hops` wake-ups at the host's measured lateness (`RunFacts.host_wakeups`, on a host
    other work filled; its percentile `stat`, like for like): the host's late wake-ups make
    it."""
    wakeups = facts.host_wakeups
    a, b = finding.evidence.get(slow), finding.evidence.get(typical)
    if wakeups is None or not (finite(a) and finite(b)):
        return False
    return a - b <= hops * getattr(wakeups, stat)


def _steps_late_by_the_host(finding: Finding, facts: RunFacts) -> bool:
    """The engine's steps vary no more than one wake-up each, late by the host: their p90
    over their p50 within the probe's p99 (the slow-step reading's own steps are measured
    against the host in `SlowSteps`, their slowest against the probe's latest); or, with
    cadence's per-step wait for a CPU, the slow steps' threads waited for a CPU at least as
    long as those steps were late (`_slow_steps_waited`, each step's wait counted at least a
    wake-up as late as the probe's latest)."""
    return (
        _late_by_the_host(finding, facts, "engine_step_p90_ms", "engine_step_p50_ms", 1, "p99")
        or _late_by_the_host(
            finding, facts, "engine_gap_at_those_max_ms", "engine_gap_p50_ms", 1, "max"
        )
        or bool(_slow_steps_waited(facts, facts.host_late_ms or 0.0))
    )


def _slow_steps_waited(facts: RunFacts, host_late_ms: float = 0.0) -> bool | None:
    """With cadence's per-step wait for a CPU (`StepsWaitedForCpu`), on a host with no core
    to spare: whether each worker's slow steps (under the slow gaps) waited for a CPU, beyond
    their usual, at least as long as they took beyond its typical step; None where the run
    has no such figure (a result from before it, another server, no /proc on the server)."""
    found = recognised(facts, StepsWaitedForCpu)
    if found is None:
        return None
    tail, waits = found
    return waits.covers(tail.reads.slow, host_late_ms)


def _steps_waited_for_cpu(finding: Finding, facts: RunFacts) -> bool:
    """On a host with no core to spare (`RunFacts.host_full`), the threads of each worker
    whose steps were slow waited for a CPU at least as long as those slow steps took beyond
    its typical step: a step thread kept off a CPU makes a slow step that is the host's, not
    the engine's compute. Read from the steps' own waits where the server measured them
    (`_slow_steps_waited`); else approximated from the sampled threads: the busiest thread's
    wait over the whole run against the slow steps' excess (`SlowSteps.excess_ms_by_worker`).
    A worker whose slow steps outlast its waits (an engine that jitters on a busy host)
    keeps the finding. Where other work filled the host, `server_threads_wait_for_cpu` gives
    way to `host_contended`, whose own reading of the steps decides
    (`_steps_late_by_the_host`)."""
    if facts.host_full is None or facts.contention is not None:
        return False
    exact = _slow_steps_waited(facts)
    if exact is not None:
        return exact
    found = recognised(facts, SlowSteps)
    waited = step_thread_waits_ms(facts)
    if found is None or not waited:
        return False
    tail, slow_steps = found
    excess = slow_steps.excess_ms_by_worker(tail.reads.slow)
    return bool(excess) and all(
        worker in waited and waited[worker] >= ms for worker, ms in excess.items()
    )


PATH_HOPS = HOPS - 1
"""The way from the step to the client wakes the front's loop and the client's read: two of
a token's wake-ups (`noise_floor.HOPS`)."""


HOST_TAIL_SHARE = 1 - UNEXPLAINED_MIN_SHARE
"""...or the host's late wake-ups explain at least this share of the gaps' tail (`HostDelays`,
what no cause of the server's claimed): the rest is within what the verdict leaves
unexplained."""


def _path_late_by_the_host(finding: Finding, facts: RunFacts) -> bool:
    """The path's spread (token delay p90 over p50) within PATH_HOPS wake-ups at the probe's
    p99, or its slow gaps the host's (HOST_TAIL_SHARE), or the ITL tail within the run's
    bound, whose noise floor holds the host's wake-ups: a host that wakes the front and the
    client late makes the spread, not the network side. The probe is one sleeping thread;
    a busy front's or client's threads wait for a CPU more often than it does, which the
    coincidence reading's per-gap claim of the host's latest wake-ups allows for."""
    if facts.host_wakeups is not None and itl_tail_within_bound(facts.result):
        return True
    if _late_by_the_host(
        finding, facts, "token_delay_p90_ms", "token_delay_p50_ms", PATH_HOPS, "p99"
    ):
        return True
    found = recognised(facts, HostDelays)
    return found is not None and found[0].itl_share(RULE_HOST_CONTENDED) >= HOST_TAIL_SHARE


RULES = (
    Rule(
        RULE_ITL_UNSTABLE_ENGINE,
        unstable_engine,
        # A slow card's streams have the slow gaps: that card is the finding.
        gives_way_to=(
            GiveWay(RULE_FRONT_LOOP_BLOCKED, _engine_in_front),
            GiveWay(RULE_SLOW_WORKER),
            GiveWay(RULE_HOST_CONTENDED, _steps_late_by_the_host),
            # A full host kept the step threads off a CPU: the slow steps are its.
            GiveWay(RULE_SERVER_THREADS_WAIT_FOR_CPU, _steps_waited_for_cpu),
        ),
    ),
    Rule(
        RULE_ITL_UNSTABLE_NETWORK,
        unstable_network_side,
        gives_way_to=(GiveWay(RULE_HOST_CONTENDED, _path_late_by_the_host),),
    ),
    Rule(RULE_SLOW_READER, slow_reader),
)

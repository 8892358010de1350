"""The signatures a slow gap or a slow first output can carry, each read from what happened at
the same instants across every stream (`reads.Reads`), whatever the protocol.

A signature is first recognised over the whole run (`detect`: its pattern holds, or None),
then asked how much of each slow gap's and each slow first output's remaining excess it
explains (`claim_gap`, `claim_first`): `coincidence.attribute` goes through them in order, so
where causes overlap each takes its part and none needs another to be absent. Each one's
thresholds stand beside it; `evidence` holds the numbers that made it hold.
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import statistics
from collections.abc import Sequence

import numpy as np
from scipy import stats  # type: ignore[import-untyped]  # scipy ships no types

from cadence.lab.analysis import dependence
from cadence.lab.analysis.diagnosis.client import CLIENT_BUSY_SHARE
from cadence.lab.analysis.diagnosis.engine_waits import engine_waits, prefill_waits
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import (
    RULE_ARRIVALS_STALL_STREAMS,
    RULE_CLIENT_READ_LATE,
    RULE_DECODE_POOL_BOTTLENECK,
    RULE_GAPS_AT_FIXED_VALUES,
    RULE_HOST_CONTENDED,
    RULE_ITL_UNSTABLE_ENGINE,
    RULE_ONE_STREAM_AT_A_TIME,
    RULE_OUTPUT_HELD_BACK,
    RULE_PREFILL_POOL_BOTTLENECK,
    RULE_PREFILL_STALLS_DECODE,
    RULE_SERVER_THREADS_WAIT_FOR_CPU,
    RULE_SLOW_FIRST_MESSAGE,
    RULE_SLOW_STREAM_GROUP,
    RULE_STREAMS_STALL_TOGETHER,
    RULE_TTFT_DEPENDS_ON,
    RULE_TTFT_GROWS_WITH_STREAMS,
)
from cadence.lab.analysis.diagnosis.reads import (
    NS_PER_MS,
    SLOW_GAP_MS,
    SLOW_GAP_RATIO,
    Gap,
    Reads,
    StreamReads,
)
from cadence.lab.analysis.noise_floor import HOPS
from cadence.lab.analysis.timeline import BURST_CHAIN_MS, MIN_BURST
from cadence.lab.percentile import percentile
from cadence.lab.results import BenchResult

COINCIDE_MS = 2.0
COINCIDE_SHARE = 0.4
"""Outputs of different streams arrived at one instant (one engine step's outputs) within
this many ms or this share of the typical gap, whichever is more: a client process reads one
step's outputs of 16-32 streams over 1-3 ms on a busy 2-core host."""


def coincide_ns(reads: Reads) -> float:
    return max(COINCIDE_MS, COINCIDE_SHARE * reads.typical_ms) * NS_PER_MS


class Signature:
    """A cause recognised over the run; the rule of that name reports it."""

    rule = ""
    evidence: dict

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> Signature | None:
        """The signature when the run carries it, else None (each kind reads its own)."""
        raise NotImplementedError

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        return 0.0

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return 0.0


# -- output held back: several outputs in one read, at the engine's rate ---------------------

HELD_READ_SHARE = 0.5
"""Output is held back when at least this share of the reads after the first carry two tokens
or more (a writer that flushes every N outputs, a sender that batches): a server that sends
as it makes has one per read, the odd pair aside."""

HELD_RATE_RATIO = 1.5
"""...and those reads come at the engine's rate: their gap per token within this factor of
the typical one (a read of five after five steps, not a late read after a stall)."""


class HeldBack(Signature):
    rule = RULE_OUTPUT_HELD_BACK

    def __init__(self, reads: Reads, per_read: float, share: float, rate: float) -> None:
        self.typical = reads.typical_ms
        self.evidence = {
            "tokens_per_read_p50": per_read,
            "reads_with_several_share": share,
            "gap_per_token_over_typical": rate,
        }

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> HeldBack | None:
        result = facts.result
        if result.segments_ms or result.workload.read_delay_ms:
            return None  # cadence's own timing names its merges (slow_reader); a slow client
        if (result.client.busiest_process_cpu_share or 0.0) >= CLIENT_BUSY_SHARE:
            return None  # a client this busy reads late: outputs pile up on its side
        later = reads.gaps
        several = [g for g in later if g.tokens >= 2]
        if not later or len(several) < HELD_READ_SHARE * len(later):
            return None
        rate = statistics.median(g.ms / g.tokens for g in several) / reads.typical_ms
        if rate > HELD_RATE_RATIO:
            return None
        per_read = statistics.median(g.tokens for g in later)
        return cls(reads, per_read, round(len(several) / len(later), 3), round(rate, 2))

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        return min(remaining_ms, (gap.tokens - 1) * self.typical)

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return min(remaining_ms, (stream.tokens[0] - 1) * self.typical)


# -- disaggregated serving: the hand-off, and the wait for a prefill worker ------------------


class HandOffGaps(Signature):
    """With the server's timing of a disaggregated server: a stream's gap across its hand-off
    (from its prefill worker's first output to its decode worker's first) is the hand-off's:
    the state's export and its wait for room on a decode worker, not a step of either."""

    rule = RULE_DECODE_POOL_BOTTLENECK

    def __init__(self, evidence: dict) -> None:
        self.evidence = evidence

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> HandOffGaps | None:
        across = [g for g in reads.gaps if g.read == g.stream.handoff_read]
        if not across:
            return None
        slow = sorted(g.ms for g in across if g.ms > reads.slow_gap_ms)
        evidence = {"gaps_across_handoffs": len(across), "slow_gaps_across_handoffs": len(slow)}
        return cls(evidence)

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        return remaining_ms if gap.read == gap.stream.handoff_read else 0.0


class PrefillPoolWait(Signature):
    """With the server's timing of a disaggregated server: a slow first output made on a
    prefill worker took, on the server, the wait for that worker and its prefill step."""

    rule = RULE_PREFILL_POOL_BOTTLENECK

    def __init__(self, evidence: dict) -> None:
        self.evidence = evidence

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> PrefillPoolWait | None:
        prefilled = [s for s in reads.streams if s.prefilled_ms]
        if not prefilled:
            return None
        return cls({"first_outputs_from_prefill_workers": len(prefilled)})

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return min(remaining_ms, stream.prefilled_ms)


# -- prefill inside the decode step: slow gaps end with other streams' first outputs ---------

PREFILL_SLOW_SHARE = 0.5
"""Joining streams stall the others when at least this share of the gaps that end with a new
stream's first output are slow (prefill in the step: nearly all; a pause that happens to
catch a join: a share near the time it pauses)."""

PREFILL_CONTRAST = 3.0
"""...this many times the share of slow gaps among those that end with no first output..."""

PREFILL_MIN_GAPS = 10
"""...over at least this many gaps ending with a first output."""

PREFILL_MIN_MS = 2.0
"""...and each new stream adds at least this many ms to the step (the fit's slope)."""

PREFILL_CLAIM_SLACK = 1.25
"""A gap's claim is the fitted cost of the streams that joined, with this much room for the
step's own variation."""


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Least squares through the origin: y per unit of x."""
    den = sum(x * x for x, _ in points)
    return sum(x * y for x, y in points) / den if den else 0.0


class PrefillStalls(Signature):
    rule = RULE_PREFILL_STALLS_DECODE

    def __init__(
        self, reads: Reads, per_stream: float, per_token: float | None, evidence: dict
    ) -> None:
        self.reads = reads
        self.window = coincide_ns(reads)
        self.per_stream = per_stream
        self.per_token = per_token
        self.evidence = evidence

    @functools.cached_property
    def waits(self) -> dict[int, float]:
        """Stream number → how long the engine ran other streams' prefills while it waited
        for its first output (ms, `engine_waits.prefill_waits`); read once a first output is
        claimed (`BurstSpread` detects this signature only to know whether it holds)."""
        return prefill_waits(self.reads, self.window)

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> PrefillStalls | None:
        window = coincide_ns(reads)
        prompts = sorted(s.prompt_tokens for s in reads.streams)
        # Each gap against its own stream's pace, so that a slower card's every gap is not
        # taken for a stall (nor its joins for a fast card's).
        joined: list[tuple[float, bool, int, int]] = []
        alone: list[tuple[float, bool, int, int]] = []
        for g in reads.gaps:
            expected = g.tokens * (g.stream.speed_ms or reads.typical_ms)
            over = g.ms - expected
            slow = g.ms > SLOW_GAP_RATIO * expected + SLOW_GAP_MS
            n, tokens = reads.joined_at(g.t1, window, g.stream.number)
            (joined if n else alone).append((over, slow, n, tokens))
        if len(joined) < PREFILL_MIN_GAPS or not alone:
            return None
        share = sum(1 for _, slow, _, _ in joined if slow) / len(joined)
        share_alone = sum(1 for _, slow, _, _ in alone if slow) / len(alone)
        if share < PREFILL_SLOW_SHARE or share < PREFILL_CONTRAST * share_alone:
            return None
        per_stream = _slope([(n, over) for over, _, n, _ in joined])
        if per_stream < PREFILL_MIN_MS:
            return None
        varied = prompts and prompts[-1] > prompts[0]
        per_token = _slope([(t, over) for over, _, _, t in joined]) if varied else None
        evidence = {
            "ms_per_new_stream": round(per_stream, 2),
            "gaps_ending_with_new_streams": len(joined),
            "slow_share_of_those": round(share, 3),
            "slow_share_of_other_gaps": round(share_alone, 3),
            "new_streams_per_join_p50": statistics.median(n for _, _, n, _ in joined),
        }
        if per_token is not None:
            evidence["ms_per_new_prompt_token"] = round(per_token, 3)
        return cls(reads, per_stream, per_token, evidence)

    def _cost(self, n: int, tokens: int) -> float:
        cost = self.per_stream * n
        if self.per_token is not None:
            cost = max(cost, self.per_token * tokens)
        return PREFILL_CLAIM_SLACK * cost

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        n, tokens = self.reads.joined_at(gap.t1, self.window, gap.stream.number)
        return min(remaining_ms, self._cost(n, tokens)) if n else 0.0

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        # The streams admitted in the same step made this one wait for their prefill too,
        # and so did those of every admitting step it waited through before: what the steps
        # took for them where the engine's time shows it, else their fitted cost.
        n, tokens = self.reads.joined_at(stream.first_ns, self.window, stream.number)
        fitted = self._cost(n, tokens) if n else 0.0
        return min(remaining_ms, max(fitted, self.waits.get(stream.number, 0.0)))


# -- the engine's own steps slow at the slow gaps (the server's timing) ---------------------

STEP_MIN_SLOW_GAPS = 3
"""The engine's steps explain slow gaps when at least this many slow gaps fall on a slow step
of their own."""


class EngineGaps:
    """With the server's timing (cadence's `t_step_end_ns`), the engine's own time between the
    steps that made a gap's two reads, and with cadence's per-step wait for a CPU
    (`t_step_cpu_wait_ns`) how long the engine's threads waited for one in that time: each
    against the typical of the stream's own worker (its median per token), so that a card
    that is steadily slower, or a worker whose threads always wait a little, is no slow step.

    The waits are read only where the host had no core to spare (`RunFacts.host_full`),
    where `StepsWaitedForCpu` names whose they are; elsewhere a step's wait is none."""

    def __init__(self, reads: Reads, facts: RunFacts) -> None:
        gaps: dict[int, list[float]] = {}
        waits: dict[int, list[float]] = {}
        self.with_waits = facts.host_full is not None and any(s.step_waits for s in reads.streams)
        for g in reads.gaps:
            engine = self.engine_ms(g)
            if engine is None:
                continue
            tokens = max(g.tokens, 1)
            gaps.setdefault(g.stream.worker, []).append(engine / tokens)
            wait = self._wait_ms(g)
            if wait is not None:
                waits.setdefault(g.stream.worker, []).append(wait / tokens)
        self.typical = {w: statistics.median(v) for w, v in gaps.items()}
        """Each worker's typical engine gap per token (ms)."""
        self.typical_wait = {w: statistics.median(v) for w, v in waits.items()}
        """Each worker's typical wait for a CPU per token (ms): its steps' usual share of the
        host's, in `typical` already."""

    @staticmethod
    def engine_ms(gap: Gap) -> float | None:
        ends = gap.stream.step_ends
        if not ends or gap.read == gap.stream.handoff_read:
            return None  # no timing, or steps of two workers (a hand-off: `HandOffGaps`)
        return (ends[gap.read] - ends[gap.read - 1]) / NS_PER_MS

    def _wait_ms(self, gap: Gap) -> float | None:
        waits = gap.stream.step_waits
        if not self.with_waits or not waits or gap.read == gap.stream.handoff_read:
            return None
        wait = waits[gap.read]
        return wait if wait >= 0 else None

    def late_ms(self, gap: Gap) -> float | None:
        """How much longer than its worker's typical the engine took over the gap (ms), or
        None without the server's timing."""
        engine = self.engine_ms(gap)
        typical = self.typical.get(gap.stream.worker)
        if engine is None or typical is None:
            return None
        return engine - typical * max(gap.tokens, 1)

    def waited_ms(self, gap: Gap) -> float:
        """How much longer than its worker's typical the engine's threads waited for a CPU
        over the gap (ms): 0 where that is not known."""
        wait = self._wait_ms(gap)
        usual = self.typical_wait.get(gap.stream.worker)
        if wait is None or usual is None:
            return 0.0
        return max(0.0, wait - usual * max(gap.tokens, 1))

    def first_waited_ms(self, stream: StreamReads) -> float:
        """How much longer than its worker's typical the threads of the step that made the
        stream's first output waited for a CPU (ms), from the worker's step before it: 0
        where that is not known, or the step was a prefill worker's (disaggregated)."""
        waits = stream.step_waits
        usual = self.typical_wait.get(stream.worker)
        if not self.with_waits or not waits or waits[0] < 0 or usual is None:
            return 0.0
        if stream.prefilled_ms:
            return 0.0
        return max(0.0, waits[0] - usual * max(stream.tokens[0], 1))

    def slow_steps(self, slow: Sequence[Gap]) -> dict[int, dict[int, tuple[float, float]]]:
        """The steps under the slow gaps `slow` that came more than SLOW_GAP_MS late, by
        worker and step end: (how late, how much longer than usual its threads waited for a
        CPU), each step once however many streams' gaps it made (a batch's step ends every
        stream's gap at once)."""
        steps: dict[int, dict[int, tuple[float, float]]] = {}
        for gap in slow:
            late = self.late_ms(gap)
            if late is None or late <= SLOW_GAP_MS:
                continue
            end = gap.stream.step_ends[gap.read]
            steps.setdefault(gap.stream.worker, {})[end] = (late, self.waited_ms(gap))
        return steps


class SlowSteps(Signature):
    """With the server's timing (cadence's `t_step_end_ns`), each slow gap is set against the
    engine's own time between the steps that made its two reads (`EngineGaps`): when the
    card's compute fluctuated, the engine's gap holds the client's. Measured against the
    typical gap of the stream's own worker, so a card that is steadily slower is a slower
    group, not jitter.

    On a host other work filled, a step's own wake-up may come as late as the run's wake-up
    probe measured (`RunFacts.host_late_ms`), and on a host with no core to spare its threads
    may have waited for a CPU (`EngineGaps.waited_ms`, cadence's per-step figure): whichever
    is more of a slow step is the host's, left to `StepsWaitedForCpu` and `HostDelays`, and a
    step no later than that is no slow step of the engine's."""

    rule = RULE_ITL_UNSTABLE_ENGINE

    def __init__(self, gaps: EngineGaps, evidence: dict, host_late_ms: float = 0.0) -> None:
        self.gaps = gaps
        self.evidence = evidence
        self.host_late_ms = host_late_ms

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> SlowSteps | None:
        gaps = EngineGaps(reads, facts)
        if not gaps.typical:
            return None
        signature = cls(gaps, {}, facts.host_late_ms or 0.0)
        on_slow_steps = [g for g in reads.slow if signature.claim_gap(g, g.excess_ms) > 0]
        if len(on_slow_steps) < STEP_MIN_SLOW_GAPS:
            return None
        # A gap claims a slow step only where the engine's gap is known (`claim_gap`).
        steps = sorted(e for g in on_slow_steps if (e := gaps.engine_ms(g)) is not None)
        signature.evidence = {
            "engine_gap_p50_ms": round(statistics.median(gaps.typical.values()), 2),
            "slow_gaps_on_slow_steps": len(on_slow_steps),
            "slow_gaps": len(reads.slow),
            "engine_gap_at_those_p50_ms": round(percentile(steps, 50), 2),
            "engine_gap_at_those_max_ms": round(steps[-1], 2),
        }
        if signature.host_late_ms:
            signature.evidence["host_late_per_step_ms"] = round(signature.host_late_ms, 2)
        return signature

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        late = self.gaps.late_ms(gap)
        if late is None:
            return 0.0
        over = late - max(self.host_late_ms, self.gaps.waited_ms(gap))
        return min(remaining_ms, over) if over > SLOW_GAP_MS else 0.0

    def excess_ms_by_worker(self, slow: Sequence[Gap]) -> dict[int, float]:
        """How much longer than its worker's typical the slow steps under the slow gaps
        `slow` took, together, by worker (ms): each step once, however many streams' gaps it
        made (a batch's step ends every stream's gap at once)."""
        claimed = [gap for gap in slow if self.claim_gap(gap, gap.excess_ms) > 0]
        return {
            worker: sum(late for late, _ in by_end.values())
            for worker, by_end in self.gaps.slow_steps(claimed).items()
        }


class StepsWaitedForCpu(Signature):
    """With cadence's per-step wait for a CPU (`t_step_cpu_wait_ns`: how long the worker's
    engine threads were ready to run but waited in the kernel's run queue, from its previous
    step's end to the step's), on a host with no core to spare: the part of a slow gap that
    its step's threads spent waiting for a CPU beyond what its worker's steps usually wait,
    up to how late the step came (`EngineGaps`), is the host's, not the engine's compute. A
    thread ready to run on a full host waits for the one running to use up its scheduler
    slice, longer than the host's wake-up probe (a sleeping thread) is ever late. Of a slow
    first output, what its first step's threads waited beyond their usual.

    Whose it is: the host's (`host_contended`) when other work filled it, else the server's
    own threads' (`server_threads_wait_for_cpu`: the server and its load fill the host)."""

    rule = RULE_HOST_CONTENDED

    def __init__(self, gaps: EngineGaps, rule: str, evidence: dict) -> None:
        self.gaps = gaps
        self.rule = rule
        self.evidence = evidence

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> StepsWaitedForCpu | None:
        gaps = EngineGaps(reads, facts)
        if not gaps.with_waits or not gaps.typical_wait:
            return None
        rule = (
            RULE_HOST_CONTENDED
            if facts.contention is not None
            else RULE_SERVER_THREADS_WAIT_FOR_CPU
        )
        waited = [w for g in reads.slow if (w := gaps.waited_ms(g)) > 0]
        evidence: dict = {
            "step_cpu_wait_p50_ms": round(statistics.median(gaps.typical_wait.values()), 3),
            "slow_gaps_on_steps_that_waited": len(waited),
        }
        if waited:
            evidence["step_cpu_wait_at_those_max_ms"] = round(max(waited), 2)
        return cls(gaps, rule, evidence)

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        late = self.gaps.late_ms(gap)
        if late is None or late <= 0:
            return 0.0
        return min(remaining_ms, late, self.gaps.waited_ms(gap))

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        # The first output's step is in its TTFT whole: what its threads waited beyond
        # their usual is time the first output lost.
        return min(remaining_ms, self.gaps.first_waited_ms(stream))

    def covers(self, slow: Sequence[Gap], host_late_ms: float = 0.0) -> bool:
        """Whether the slow steps under the slow gaps `slow` (`EngineGaps.slow_steps`) are the
        host's: for each worker, its threads waited for a CPU, beyond their usual, at least as
        long as those steps took beyond its typical step, together (each step's wait counted
        at least `host_late_ms`, a wake-up the host made late). False when no step was slow:
        then no slow step is the host's either."""
        steps = self.gaps.slow_steps(slow)
        return bool(steps) and all(
            sum(max(host_late_ms, waited) for _, waited in by_end.values())
            >= sum(late for late, _ in by_end.values())
            for by_end in steps.values()
        )


# -- every open stream paused at the same instants ------------------------------------------

STALL_GAPS = 4.0
STALL_MIN_MS = 20.0
"""A silence of every other stream counts as a server-wide stall from this many typical gaps
and this many ms above one (as `timeline.STALL_GAP_FACTOR`, `timeline.STALL_MIN_MS`: heavy
jitter makes a step 3x its median, never 4x)."""

STALL_MIN_OTHERS = 2
"""...while at least this many other streams were receiving across it."""


class SharedStalls(Signature):
    rule = RULE_STREAMS_STALL_TOGETHER

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self.threshold = max(STALL_GAPS * reads.typical_ms, reads.typical_ms + STALL_MIN_MS)
        self.instants: list[tuple[int, float]] = []
        """(end, length ms) of each silence a claim was made for."""
        self.evidence = {}

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> SharedStalls:
        return cls(reads)  # the claims say whether it holds: see `finish`

    def _silence(self, t0: int, t1: int, stream: int) -> float:
        if self.reads.open_at(t0) - 1 < STALL_MIN_OTHERS:
            return 0.0
        silence = self.reads.silence_ms(t0, t1, stream)
        return silence if silence >= self.threshold else 0.0

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        silence = self._silence(gap.t0, gap.t1, gap.stream.number)
        if not silence:
            return 0.0
        self.instants.append((gap.t1, silence))
        return min(remaining_ms, silence - self.reads.typical_ms)

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        silence = self._silence(stream.start_ns, stream.first_ns, stream.number)
        return min(remaining_ms, silence - self.reads.typical_ms) if silence else 0.0

    def stalls(self) -> list[tuple[int, float]]:
        """The distinct stalls claimed for: the silences of many gaps that end together."""
        out: list[tuple[int, float]] = []
        for end, length in sorted(self.instants):
            if out and end - out[-1][0] <= length * NS_PER_MS:
                out[-1] = (out[-1][0], max(out[-1][1], length))
            else:
                out.append((end, length))
        return out


# -- a subset of the streams slower than the rest -------------------------------------------

GROUP_RATIO = 1.5
"""Two speed groups: the slow group's median time per token (`StreamReads.speed_ms`) this many
times the fast group's."""
GROUP_SEPARATION = 1.25
"""...with no stream between them: the slow group's fastest this many times the fast group's
slowest."""
GROUP_MIN_SHARE = 0.1
"""Each group holds at least this share of the streams (and two streams)."""
GROUP_MIN_STREAMS = 8
GROUP_MIN_READS = 5
GROUP_SIDE_BY_SIDE = 0.5
"""...and the groups ran side by side: at the median, a fast stream received while a slow one
was receiving too for at least this share of its time. Streams a different moment of the run
served faster (a wave of them alone after the others, a quieter spell of the host) are a
dependence on the run's time, not a part of the streams served by something slower."""


def _side_by_side(fast: list[StreamReads], slow: list[StreamReads]) -> float:
    """The median share of a fast stream's receiving time during which a slow stream was
    receiving too."""
    spans = sorted((s.first_ns, s.end_ns) for s in slow)
    shares = []
    for f in fast:
        length = f.end_ns - f.first_ns
        if length <= 0:
            continue
        covered, reach = 0, f.first_ns
        for a, b in spans:
            a, b = max(a, reach), min(b, f.end_ns)
            if b > a:
                covered += b - a
                reach = b
        shares.append(covered / length)
    return statistics.median(shares) if shares else 0.0


class SlowGroup(Signature):
    rule = RULE_SLOW_STREAM_GROUP

    def __init__(
        self, slow: dict[int, float], fast: list[float], ratio: float, streams: int
    ) -> None:
        self.slow = slow
        """Stream number → its time per token, for the slow group."""
        self.fast_ms = statistics.median(fast)
        slow_speeds = sorted(slow.values())
        self.evidence = {
            "streams": streams,
            "slow_streams": len(slow),
            "slow_itl_p50_ms": round(statistics.median(slow_speeds), 2),
            "fast_itl_p50_ms": round(self.fast_ms, 2),
            "fastest_slow_itl_ms": round(slow_speeds[0], 2),
            "slowest_fast_itl_ms": round(max(fast), 2),
            "slow_over_fast": round(ratio, 2),
        }

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> SlowGroup | None:
        # A stream with reads has a speed (`speed_ms`).
        speeds = sorted(
            (v, s.number)
            for s in reads.streams
            if len(s.per_token_ms) >= GROUP_MIN_READS and (v := s.speed_ms) is not None
        )
        if len(speeds) < GROUP_MIN_STREAMS:
            return None
        least = max(2, int(GROUP_MIN_SHARE * len(speeds) + 0.999))
        best = None
        values = [v for v, _ in speeds]
        for split in range(least, len(speeds) - least + 1):
            fast, slow = values[:split], values[split:]
            if fast[-1] > 0 and slow[0] / fast[-1] >= GROUP_SEPARATION:
                ratio = statistics.median(slow) / statistics.median(fast)
                if ratio >= GROUP_RATIO and (best is None or ratio > best[0]):
                    best = (ratio, split)
        if best is None:
            return None
        ratio, split = best
        by_number = {s.number: s for s in reads.streams}
        fast_streams = [by_number[n] for _, n in speeds[:split]]
        slow_streams = [by_number[n] for _, n in speeds[split:]]
        if _side_by_side(fast_streams, slow_streams) < GROUP_SIDE_BY_SIDE:
            return None
        return cls({n: v for v, n in speeds[split:]}, values[:split], ratio, len(speeds))

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        speed = self.slow.get(gap.stream.number)
        if speed is None:
            return 0.0
        return min(remaining_ms, gap.tokens * (speed - self.fast_ms))


# -- gaps that cluster at one fixed value (a timer, a poll timeout) --------------------------

TIMER_TOLERANCE_MS = 2.0
TIMER_TOLERANCE_SHARE = 0.08
"""A cluster is gaps within this many ms, or this share of its value, of one value."""

TIMER_SHARE = 0.3
"""The cluster holds at least this share of the slow gaps left unexplained..."""

TIMER_MIN_GAPS = 5
"""...and this many."""

TIMER_MIN_INSTANTS = 5
"""...at this many distinct instants at least (gaps that end within a typical gap of each other
are one instant): one hiccup of a busy host stretches many streams' gaps by the same amount
once; a timer fires again and again."""

TIMER_MIN_TYPICAL = 3.0
"""...at a value of this many typical gaps at least (a step stretched by jitter or a busy host
lands near two)..."""

TIMER_PER_INSTANT = 2.5
"""...hitting at most this many streams per instant on average: a timer of each stream's own
(a reader's poll timeout) fires for one stream at a time, where a long step of the engine
stretches the gaps of every stream it serves at once."""

TIMER_SHARP = 2.0
"""...and is sharp: this many times the gaps in the band of four tolerances either side
(a pause or a slow step spreads; a timeout ends on time)."""


class FixedGaps(Signature):
    """Run last among the gap signatures: it reads what the others left."""

    rule = RULE_GAPS_AT_FIXED_VALUES

    def __init__(self, value: float, tolerance: float, evidence: dict) -> None:
        self.value = value
        self.tolerance = tolerance
        self.evidence = evidence

    @classmethod
    def among(cls, reads: Reads, left: list[Gap]) -> FixedGaps | None:
        """The sharpest cluster of the slow gaps in `left` (those no other signature claimed
        any of: what is left of a gap another cause shortened has no value of its own), when
        there is one."""
        values = sorted(g.ms for g in left)
        if len(values) < TIMER_MIN_GAPS:
            return None
        best = None
        for v in values:
            tol = max(TIMER_TOLERANCE_MS, TIMER_TOLERANCE_SHARE * v)
            inside = _count(values, v - tol, v + tol)
            if best is None or inside > best[0]:
                best = (inside, v, tol)
        if best is None:
            return None  # not reached: there are TIMER_MIN_GAPS values
        inside, v, tol = best
        # Center on the cluster's median, then measure it and the band around it.
        center = statistics.median(x for x in values if abs(x - v) <= tol)
        inside = _count(values, center - tol, center + tol)
        band = _count(values, center - 4 * tol, center + 4 * tol) - inside
        ends = sorted(g.t1 for g in left if abs(g.ms - center) <= tol)
        apart = reads.typical_ms * NS_PER_MS
        instants = 1 + sum(1 for a, b in itertools.pairwise(ends) if b - a > apart) if ends else 0
        if (
            inside < TIMER_MIN_GAPS
            or instants < TIMER_MIN_INSTANTS
            or center < TIMER_MIN_TYPICAL * reads.typical_ms
            or inside > TIMER_PER_INSTANT * instants
            or inside < TIMER_SHARE * len(values)
            or inside < TIMER_SHARP * band
        ):
            return None
        return cls(
            center,
            tol,
            {
                "gap_value_ms": round(center, 1),
                "tolerance_ms": round(tol, 1),
                "gaps_at_value": inside,
                "instants": instants,
                "slow_gaps_left": len(values),
                "gaps_near_but_outside": band,
                "typical_gap_ms": round(reads.typical_ms, 2),
            },
        )

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        return remaining_ms if abs(gap.ms - self.value) <= self.tolerance else 0.0


def _count(values: list[float], lo: float, hi: float) -> int:
    return bisect.bisect_right(values, hi) - bisect.bisect_left(values, lo)


# -- one stream at a time: no batching -------------------------------------------------------

SERIAL_SILENCE_SHARE = 0.45
"""Streams are served one at a time when, at the median, the longest silence of the other
streams (of its own worker, where the server's timing names the workers) inside a stream's
gap is at most this share of it: batched streams all get their
output at the end of one step, so the rest of the gap is silent (0.6-1.0 measured); streams
served in turn fill each other's gaps (1/N of it with N open)."""

SERIAL_MIN_OPEN = 4
"""...with at least this many streams receiving at the median (with two or three, turns and
batches look alike)."""

SERIAL_SAMPLE = 400
"""Gaps read for the test (spread over the run)."""

SERIAL_TOGETHER_SHARE = 0.25
"""...and when, inside a stream's gap at the median, at most this share of the other streams'
outputs arrived together with another's (closer than half the spacing they would have spread
evenly over the gap): streams served in turn arrive one by one (0 measured), while one
batch's outputs are read one right after another (0.43-1.0 measured with 2 to 4 workers
stepping out of phase, whose batches do fill each other's gaps)."""


SERIAL_SHARED_STEPS = 0.5
"""With the server's timing (each output's step end), streams are batched, never served in
turn, when at least this share of their outputs came from a step that made another stream's
output too: the reads' spacing then is the way out (a front or a client that sends or reads
one stream's output after another's, each a share of a fast step), not the engine's."""


def _steps_shared(reads: Reads) -> float | None:
    """The share of the streams' outputs whose step (its end on the server's clock) made
    another stream's output too; None without the server's timing."""
    ends = collections.Counter(e for s in reads.streams for e in s.step_ends if e)
    total = sum(ends.values())
    return sum(n for n in ends.values() if n > 1) / total if total else None


def _judged_apart(reads: Reads, result: BenchResult) -> list[Reads]:
    """Each worker's streams apart when the server's timing names two or more workers (each
    steps its own batch: another worker's outputs inside a stream's gap say nothing of how its
    own are served); else the run's streams together."""
    workers = {s.worker for s in reads.streams}
    if len(workers) < 2 or min(workers) < 0:
        return [reads]
    records = result.records or []
    return [Reads([r for r in records if r.worker == w]) for w in sorted(workers)]


def _together_share(reads: Reads, gap: Gap) -> float | None:
    """The share of the other streams' reads inside `gap` that came together with another's
    (SERIAL_TOGETHER_SHARE); None with fewer than two."""
    times = reads.others_inside(gap.t0, gap.t1, gap.stream.number)
    if len(times) < 2:
        return None
    apart = (gap.t1 - gap.t0) / (len(times) + 1) / 2
    together = [False] * len(times)
    for k, (a, b) in enumerate(itertools.pairwise(times)):
        if b - a <= apart:
            together[k] = together[k + 1] = True
    return sum(together) / len(times)


class OneAtATime(Signature):
    rule = RULE_ONE_STREAM_AT_A_TIME

    def __init__(self, evidence: dict) -> None:
        self.evidence = evidence

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> OneAtATime | None:
        groups = _judged_apart(reads, facts.result)
        shared = [v for group in groups if (v := _steps_shared(group)) is not None]
        if shared and statistics.median(shared) >= SERIAL_SHARED_STEPS:
            return None  # one step made several streams' outputs: a batch, read one by one
        step = max(1, len(reads.gaps) // SERIAL_SAMPLE)
        sample = [(group, g) for group in groups for g in group.gaps[::step] if g.tokens == 1]
        if not sample:
            return None
        opened = statistics.median(group.open_at(g.t0) for group, g in sample)
        if opened < SERIAL_MIN_OPEN:
            return None
        filled = statistics.median(
            group.silence_ms(g.t0, g.t1, g.stream.number) / g.ms for group, g in sample
        )
        if filled > SERIAL_SILENCE_SHARE:
            return None
        shares = [v for group, g in sample if (v := _together_share(group, g)) is not None]
        together = statistics.median(shares) if shares else 0.0
        if together > SERIAL_TOGETHER_SHARE:
            return None  # batches out of phase fill each other's gaps; turns do not arrive together
        points = [(group.open_at(g.t0), g.ms) for group, g in sample]
        per_stream = _slope(points)
        evidence = {
            "silence_share_of_gap_p50": round(filled, 3),
            "streams_receiving_p50": opened,
            "ms_per_open_stream": round(per_stream, 2),
            "typical_gap_ms": round(reads.typical_ms, 2),
            "outputs_arriving_together_share_p50": round(together, 3),
        }
        if len(groups) > 1:
            evidence["judged_per_worker"] = len(groups)
        low = [
            g.ms
            for group in groups
            for g in group.gaps
            if g.tokens == 1 and group.open_at(g.t0) <= opened / 2
        ]
        evidence["gaps_with_half_the_streams_or_fewer"] = len(low)
        if low:
            evidence["gap_p50_with_half_the_streams_or_fewer_ms"] = round(statistics.median(low), 2)
        return cls(evidence)


# -- the first output: a fixed cost, or waiting for a slot ---------------------------------

FIXED_FLOOR_PERCENTILE = 10
"""Every stream paid at least the run's TTFT at this percentile: a cost before any output."""

SLOT_WINDOW_GAPS = 2.0
SLOT_WINDOW_MS = 10.0
"""A first output that came within this many typical gaps plus this many ms after another
stream's last output was waiting for that stream's slot (a thread, a batch place)..."""

SLOT_MARGIN_MS = 2.0
"""...when that stream ended after this one had been sent (not the end that made a closed
loop send it)."""

SLOT_SHARE = 0.6
"""Slow first outputs wait for slots when at least this share of them came so (a fixed cost
or a prefill meets an end by chance in a tenth to a fifth)."""

SLOT_MIN = 3


def slot_waiters(reads: Reads) -> set[int]:
    """The streams whose slow first output came right after another stream's last output,
    which ended after they were sent (SLOT_*)."""
    window = (SLOT_WINDOW_GAPS * reads.typical_ms + SLOT_WINDOW_MS) * NS_PER_MS
    margin = SLOT_MARGIN_MS * NS_PER_MS
    waited = set()
    for s in reads.slow_firsts:
        # A first read of k tokens was made k - 1 typical gaps before it arrived.
        made = s.first_ns - (s.tokens[0] - 1) * reads.typical_ms * NS_PER_MS
        if reads.ends_between(max(made - window, s.start_ns + margin), s.first_ns):
            waited.add(s.number)
    return waited


class FixedFirstCost(Signature):
    """Claims before `WaitsForSlot`: a stream that waited for a slot paid the fixed cost too."""

    rule = RULE_SLOW_FIRST_MESSAGE

    def __init__(self, reads: Reads, floor_ms: float) -> None:
        self.cost = floor_ms - reads.typical_ms
        self.evidence = {"ttft_floor_ms": round(floor_ms, 1)}

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> FixedFirstCost | None:
        # The floor of the streams that did not wait for another to end: those that waited
        # say how long the others held their slots, not what every stream pays.
        waited = slot_waiters(reads)
        ttfts = sorted(s.ttft_ms for s in reads.streams if s.number not in waited)
        floor = percentile(ttfts, FIXED_FLOOR_PERCENTILE) if ttfts else 0.0
        return cls(reads, floor) if floor > reads.typical_ms else None

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return min(remaining_ms, self.cost)


class WaitsForSlot(Signature):
    rule = RULE_TTFT_GROWS_WITH_STREAMS

    def __init__(self, waited: set[int], evidence: dict) -> None:
        self.waited = waited
        self.evidence = evidence

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> WaitsForSlot | None:
        waited = slot_waiters(reads)
        window = (SLOT_WINDOW_GAPS * reads.typical_ms + SLOT_WINDOW_MS) * NS_PER_MS
        slow = len(reads.slow_firsts)
        if len(waited) < SLOT_MIN or len(waited) < SLOT_SHARE * slow:
            return None
        return cls(
            waited,
            {
                "slow_first_outputs": slow,
                "first_output_right_after_another_stream_ended": len(waited),
                "slot_window_ms": round(window / NS_PER_MS, 1),
            },
        )

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return remaining_ms if stream.number in self.waited else 0.0


OWN_SIZE = ("prompt_tokens", "max_tokens")
"""What a request brings itself: a wait that follows these is its own cost (a prefill) or a
scheduler's choice by it (shortest first), not its place in a queue."""


class FollowsOwnSize(Signature):
    """Claims before `WaitsForSlot`: a first output as late as the request's own size makes
    it (the TTFT's named dependence on its prompt or its output budget, `dependence`). A slot
    limit makes each request wait for those ahead of it, whatever its size; where the wait
    follows the size instead, a slot did not decide it, and only what the size leaves of it
    may be a slot's."""

    rule = RULE_TTFT_DEPENDS_ON

    def __init__(self, rise: np.ndarray, evidence: dict) -> None:
        self.rise = rise
        self.evidence = evidence

    @classmethod
    def among(cls, table: dependence.Table | None) -> FollowsOwnSize | None:
        """The strongest named dependence of the first outputs on their own size."""
        found = next((d for d in (table.named if table else ()) if d.variable in OWN_SIZE), None)
        if found is None or found.rise is None:
            return None
        return cls(found.rise, {"variable": found.variable, "shape": found.shape})

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return min(remaining_ms, float(self.rise[stream.number]))


# -- a burst of streams served one after another ---------------------------------------------

TTFT_GROWTH_GAPS = 5.0
TTFT_GROWTH_MIN_MS = 50.0
"""TTFT "grows" when the requests opened at once are served over a spread (p90 - p10 within
the largest burst) of this many typical gaps and this many ms at least: a healthy server
starts a burst within one or two steps; one that takes calls in one at a time, or runs one
thread per stream, serves the last of 32 streams hundreds of ms after the first."""


class BurstSpread(Signature):
    """Claims after `WaitsForSlot`: what is left of a burst's first outputs is their order,
    less what the engine's own steps took beyond their pace while each stream waited
    (`engine_waits`). Call set-up takes new streams in one at a time while the engine goes on
    at its pace; steps made long by the prefills they admitted, or a slower card's steps,
    spread a burst's first outputs too, and that spread is theirs, not the front's."""

    rule = RULE_TTFT_GROWS_WITH_STREAMS

    def __init__(self, after: dict[int, float], evidence: dict) -> None:
        self.after = after
        """Stream number → how long after its burst's first output its own came, less the
        engine's part of its wait, beyond the burst's least (ms)."""
        self.evidence = evidence

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> BurstSpread | None:
        high = max(TTFT_GROWTH_GAPS * reads.typical_ms, TTFT_GROWTH_MIN_MS)
        chain = BURST_CHAIN_MS * NS_PER_MS
        prefill = PrefillStalls.detect(reads, facts)
        engine = engine_waits(reads, facts.typical_step, prefill.window if prefill else None)
        after: dict[int, float] = {}
        bursts = 0
        widest = 0.0
        by_start = sorted(reads.streams, key=lambda s: s.start_ns)
        k = 0
        while k < len(by_start):
            burst = [by_start[k]]
            while (
                k + len(burst) < len(by_start)
                and by_start[k + len(burst)].start_ns - burst[-1].start_ns <= chain
            ):
                burst.append(by_start[k + len(burst)])
            k += len(burst)
            own = {s.number: s.ttft_ms - engine.get(s.number, 0.0) for s in burst}
            ordered = sorted(own.values())
            spread = percentile(ordered, 90) - percentile(ordered, 10)
            if len(burst) < MIN_BURST or spread < high:
                continue
            bursts += 1
            widest = max(widest, spread)
            for n, ms in own.items():
                after[n] = ms - ordered[0]
        if not bursts:
            return None
        evidence: dict = {"bursts_spread": bursts, "streams_in_them": len(after)}
        if engine:
            evidence["burst_spread_beyond_engine_steps_ms"] = round(widest, 1)
        return cls(after, evidence)

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return min(remaining_ms, self.after.get(stream.number, 0.0))


# -- the host's own delays: other work filled the host's cores ------------------------------


class HostDelays(Signature):
    """Other work filled the host (`RunFacts.contention`): each slow gap and slow first output
    may hold up to HOPS of the latest wake-ups the run's probe measured
    (`cadence.lab.measure.wakeups`), and no more; what is left is some other cause's."""

    rule = RULE_HOST_CONTENDED

    def __init__(self, most_ms: float, late_ms: float) -> None:
        self.most_ms = most_ms
        self.evidence = {
            "wakeup_late_max_ms": round(late_ms, 2),
            "host_delay_per_gap_ms_at_most": round(most_ms, 2),
        }

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> HostDelays | None:
        wakeups = facts.host_wakeups
        return cls(HOPS * wakeups.max, wakeups.max) if wakeups is not None else None

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        return min(remaining_ms, self.most_ms)

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return min(remaining_ms, self.most_ms)


# -- the lab's own client read late: its load loop ran behind --------------------------------

STALL_READS_MS = 2.0
"""After a stretch its loop ran late, a load process stamps the reads that came meanwhile one
after another: a read stamped this soon after the stretch ended was held by it too."""


class ClientStalls(Signature):
    """The load process that read a stream ran its loop late (`client.loop_stalls`: its
    ticks ran late, the process busy or waiting for a core): a gap or first output that
    ended in such a stretch may have been stamped late by as much as the stretch had lasted
    by then (from the gap's start at the latest), and no more."""

    rule = RULE_CLIENT_READ_LATE

    def __init__(self, stalls: dict[int, list[tuple[int, int]]], evidence: dict) -> None:
        self.stalls = stalls
        self.starts = {p: [a for a, _ in spans] for p, spans in stalls.items()}
        self.evidence = evidence

    @classmethod
    def detect(cls, reads: Reads, facts: RunFacts) -> ClientStalls | None:
        found = facts.result.client.loop_stalls or []
        if not found:
            return None
        stalls: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for process, a, b in sorted(found):
            stalls[process].append((a, b))
        lengths = [(b - a) / NS_PER_MS for _, a, b in found]
        return cls(
            dict(stalls),
            {
                "client_loop_stalls": len(found),
                "client_loop_stall_max_ms": round(max(lengths), 1),
                "client_loop_stalled_ms": round(sum(lengths), 1),
            },
        )

    def _held_ms(self, process: int, t0: int, t1: int) -> float:
        """How long the read at t1 may have waited for its process's loop: from the start of
        the stretch it ended in (or t0, the gap's start, when later)."""
        starts = self.starts.get(process)
        if not starts:
            return 0.0
        k = bisect.bisect_left(starts, t1) - 1
        if k < 0:
            return 0.0
        a, b = self.stalls[process][k]
        if t1 > b + STALL_READS_MS * NS_PER_MS:
            return 0.0
        return max(0.0, (t1 - max(a, t0)) / NS_PER_MS)

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        return min(remaining_ms, self._held_ms(gap.stream.process, gap.t0, gap.t1))

    def claim_first(self, stream: StreamReads, remaining_ms: float) -> float:
        return min(remaining_ms, self._held_ms(stream.process, stream.start_ns, stream.first_ns))


# -- new requests hold the running streams: slow gaps come as requests arrive -----------------

ARRIVAL_MIN_GAPS = 5
"""Slow gaps with a request sent inside them, at the least, for arrivals to be a cause."""
ARRIVAL_SLOW_SHARE = 0.5
"""...and at least this share of the slow gaps..."""
ARRIVAL_OVER_CHANCE = 2.0
"""...at least this many times as many as chance puts there (gaps of their lengths laid at
random over the run, with its sends where they were)..."""
ARRIVAL_P = 1e-3
"""...and no likelier than this by chance (Poisson, at the chance count)."""


class ArrivalStalls(Signature):
    """The server's handling of newly arrived requests holds the streams already running (a
    front that parses, tokenizes or admits each new call on the loop or thread that sends the
    others' tokens): slow gaps hold a request's send far more often than gaps of their
    lengths would by chance. Each slow gap that holds one is the arrival's, what is left of
    it. Read from the client's sends and reads alone, so it speaks of any server."""

    rule = RULE_ARRIVALS_STALL_STREAMS

    def __init__(self, sends: list[int], evidence: dict) -> None:
        self.sends = sends
        self.evidence = evidence

    @staticmethod
    def _holds_send(sends: list[int], gap: Gap) -> bool:
        k = bisect.bisect_right(sends, gap.t0)
        return k < len(sends) and sends[k] < gap.t1

    @classmethod
    def among(cls, reads: Reads, slow: list[Gap]) -> ArrivalStalls | None:
        """The signature when the slow gaps `slow` (those no cause of the server's timing,
        nor the client's loop, explained) hold the run's sends beyond chance, else None."""
        sends = sorted(s.start_ns for s in reads.streams)
        if len(slow) < ARRIVAL_MIN_GAPS or len(sends) < 2:
            return None
        holding = [g for g in slow if cls._holds_send(sends, g)]
        if len(holding) < ARRIVAL_MIN_GAPS or len(holding) < ARRIVAL_SLOW_SHARE * len(slow):
            return None
        # A window of length L holds a send when it ends within L after one: the measure of
        # those ends is the sum over sends of the time to the previous send, at most L.
        since = np.diff(np.asarray(sends, dtype=np.float64))
        span = float(max(reads.ends[-1], sends[-1]) - sends[0])
        chance = sum(
            min(1.0, (float(np.minimum(since, g.t1 - g.t0).sum()) + g.t1 - g.t0) / span)
            for g in slow
        )
        if len(holding) < ARRIVAL_OVER_CHANCE * chance:
            return None
        p = float(stats.poisson.sf(len(holding) - 1, chance))
        if p > ARRIVAL_P:
            return None
        return cls(
            sends,
            {
                "slow_gaps_holding_a_send": len(holding),
                "slow_gaps_judged": len(slow),
                "slow_gaps_holding_a_send_by_chance": round(chance, 1),
                "sends_p": float(f"{p:.1e}"),
            },
        )

    def claim_gap(self, gap: Gap, remaining_ms: float) -> float:
        return remaining_ms if self._holds_send(self.sends, gap) else 0.0

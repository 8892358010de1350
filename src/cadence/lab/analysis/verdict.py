"""How a run ended: a verdict for every run, never a false all-clear.

A run is healthy only when all of these hold:

- its ITL tail is near its median: ITL p99 <= min(ITL_TAIL_RATIO x p50 + max(ITL_TAIL_SLACK_MS,
  noise), ITL_TAIL_CAP_RATIO x p50 + noise), and never less than p50 + TAIL_MIN_EXCESS_MS,
  where noise is the run's own noise floor (`cadence.lab.analysis.noise_floor`: the timers'
  resolution, the host's wake-up lateness its probe measured, the client's read lag);
- its first outputs come at the engine's pace: TTFT p99 <= the time the engine needs for a
  first output on its own (the first step's p99 with cadence's timing, the engine-only
  baseline's TTFT p99 with --baseline, the server's prefill span with --otlp-receive; 0 when
  none is known) + TTFT_ITL_STEPS x the time per output (ITL p50, or the typical gap per
  token between reads where outputs come grouped) + max(TTFT_SLACK_MS, noise);
- its output is whole (no integrity fault among the checks its protocol counts);
- fewer than FAILING_SHARE of its requests failed, and it ran to its end.

A bad tail that only the lab's own client explains (`CLIENT_RULES`: its loop stamped the slow
reads late, a load process near a full core, an open loop behind its schedule), with less
than UNEXPLAINED_MIN_SHARE left unexplained, says nothing of the server: such a run is
inconclusive, not unhealthy, and its line says whose the tail is.

A tail taken over fewer than MIN_GAPS gaps (ITL) or MIN_FIRST_OUTPUTS requests (TTFT) is not
judged: its p99 is one or two values. A run with nothing bad but a tail not judged is
inconclusive, never healthy.

A bad tail is attributed to the findings that explain it (alarms: a finding of severity
`information` states the run's state and explains nothing): a finding whose evidence carries
`itl_tail_share` or `ttft_tail_share` (0..1 of that tail) explains that share; another finding
of a rule that bears on the tail (`TAIL_RULES`; a rule this module does not know bears on
both) explains it without a share. What no finding explains is the `unexplained_tail`
finding, with the evidence of `cadence.lab.analysis.tail_evidence` and what would decide it.
"""

from __future__ import annotations

import math

from cadence.lab.analysis import dependence, tail_evidence
from cadence.lab.analysis.diagnosis import FAILING_SHARE
from cadence.lab.analysis.diagnosis import names as rules
from cadence.lab.analysis.diagnosis.reads import Reads
from cadence.lab.analysis.integrity import faults
from cadence.lab.analysis.tail_bound import (
    ITL_TAIL_CAP_RATIO,
    ITL_TAIL_RATIO,
    ITL_TAIL_SLACK_MS,
    MIN_FIRST_OUTPUTS,
    MIN_GAPS,
    TTFT_ITL_STEPS,
    TTFT_SLACK_MS,
    UNEXPLAINED_MIN_SHARE,
    tails,
)
from cadence.lab.results import ALARM, BenchResult, Finding, TailVerdict, Verdict

RULE_UNEXPLAINED_TAIL = "unexplained_tail"
"""A bad tail, or the part of one, that no rule explains (a rule name: a contract)."""

HEALTHY = (
    f"ITL p99 within {ITL_TAIL_RATIO:g} x p50 + {ITL_TAIL_SLACK_MS:g} ms (or the run's "
    f"noise floor, when larger) and never above {ITL_TAIL_CAP_RATIO:g} x p50 + the noise "
    f"floor (over {MIN_GAPS}+ gaps), TTFT p99 within the "
    f"engine's own time to a first output + {TTFT_ITL_STEPS:g} outputs' time (ITL p50, or "
    f"the typical gap per token where outputs come grouped) + {TTFT_SLACK_MS:g} ms or the "
    f"noise floor (over {MIN_FIRST_OUTPUTS}+ requests), the output whole, under {FAILING_SHARE:.0%} of "
    "requests failed"
)
"""What a healthy run is, in words (from the thresholds above)."""

SHARE_KEYS = {"itl_ms": "itl_tail_share", "ttft_ms": "ttft_tail_share"}
"""The evidence key by which a finding says what share of a tail it explains."""

TAIL_RULES = {
    "itl_ms": {
        rules.RULE_ITL_UNSTABLE_ENGINE,
        rules.RULE_ITL_UNSTABLE_NETWORK,
        rules.RULE_SLOW_READER,
        rules.RULE_STREAMS_STALL_TOGETHER,
        rules.RULE_FRONT_LOOP_BLOCKED,
        rules.RULE_SLOW_WORKER,
        rules.RULE_OUTPUT_HELD_BACK,
        rules.RULE_SLOW_STREAM_GROUP,
        rules.RULE_SERVER_ONE_CORE_BOUND,
        rules.RULE_SERVER_THREADS_WAIT_FOR_CPU,
        rules.RULE_FRONT_CPU_BOUND,
        rules.RULE_CPU_BUSY_CARDS_IDLE,
        rules.RULE_CLIENT_SATURATED,
        rules.RULE_CLIENT_BEHIND_SCHEDULE,
        rules.RULE_CLIENT_READ_LATE,
        rules.RULE_ARRIVALS_STALL_STREAMS,
        rules.RULE_KV_CACHE_FULL,
        rules.RULE_HOST_CONTENDED,
    },
    "ttft_ms": {
        rules.RULE_TTFT_ENGINE_START,
        rules.RULE_TTFT_QUEUEING,
        rules.RULE_TTFT_GROWS_WITH_STREAMS,
        rules.RULE_SERVER_STREAM_LIMIT,
        rules.RULE_SLOW_CONNECT,
        rules.RULE_SLOW_FIRST_MESSAGE,
        rules.RULE_TTFT_BEFORE_SERVER,
        rules.RULE_TTFT_AFTER_SERVER,
        rules.RULE_TTFT_SERVER_QUEUE,
        rules.RULE_KV_CACHE_FULL,
        rules.RULE_SERVER_QUEUE_GROWS,
        rules.RULE_CLIENT_SATURATED,
        rules.RULE_CLIENT_BEHIND_SCHEDULE,
        rules.RULE_CLIENT_READ_LATE,
        rules.RULE_FRONT_CPU_BOUND,
        rules.RULE_FRONT_LOOP_BLOCKED,
        rules.RULE_SERVER_ONE_CORE_BOUND,
        rules.RULE_SERVER_THREADS_WAIT_FOR_CPU,
        rules.RULE_STREAMS_STALL_TOGETHER,
        rules.RULE_CPU_BUSY_CARDS_IDLE,
        rules.RULE_HOST_CONTENDED,
    },
}
"""The rules whose findings bear on each tail."""
CLIENT_RULES = frozenset(
    {rules.RULE_CLIENT_READ_LATE, rules.RULE_CLIENT_SATURATED, rules.RULE_CLIENT_BEHIND_SCHEDULE}
)
"""Rules that put a tail on the lab's own client, not on the server."""
NOT_TAIL_RULES = {
    rules.RULE_REQUESTS_FAILING,
    rules.RULE_INTEGRITY_FAULTS,
    rules.RULE_UNDER_CAPACITY,
    RULE_UNEXPLAINED_TAIL,
    rules.RULE_USAGE_ABOVE_EVENTS,
}
"""Rules that explain no tail (they make a run unhealthy on their own, or say it is fine)."""

TAIL_WORDS = {"itl_ms": "ITL", "ttft_ms": "TTFT"}
"""Each judged tail by its short name."""


def _explains(finding: Finding, metric: str) -> tuple[bool, float | None]:
    """Whether `finding` bears on the tail of `metric`, and its share when its evidence
    gives one. Information (`Finding.alarm` false) bears on none: it is the run's state, not
    a fault that made a tail."""
    if not finding.alarm:
        return False, None
    share = finding.evidence.get(SHARE_KEYS[metric])
    if isinstance(share, int | float) and math.isfinite(share):
        return True, min(1.0, max(0.0, float(share)))
    if finding.rule in NOT_TAIL_RULES:
        return False, None
    known = any(finding.rule in names for names in TAIL_RULES.values())
    return (finding.rule in TAIL_RULES[metric] if known else True), None


def _attribute(tail: TailVerdict, findings: list[Finding]) -> None:
    for f in findings:
        bears, share = _explains(f, tail.metric)
        if not bears:
            continue
        before = tail.explained_by.get(f.rule, 0.0)
        if share is None or before is None:
            tail.explained_by[f.rule] = None
        else:
            tail.explained_by[f.rule] = min(1.0, before + share)
    shares = tail.explained_by.values()
    if any(s is None for s in shares):
        tail.unexplained_share = None
    else:
        tail.unexplained_share = round(max(0.0, 1.0 - sum(s for s in shares if s is not None)), 3)


def _problems(result: BenchResult) -> list[str]:
    problems = []
    found = faults(result.integrity, result.workload)
    if found:
        problems.append(
            f"{rules.RULE_INTEGRITY_FAULTS}: " + ", ".join(f"{n} {c}" for n, c in found.items())
        )
    failed = sum(result.errors_by_code.values())
    if result.requests and failed and failed >= FAILING_SHARE * result.requests:
        problems.append(
            f"{rules.RULE_REQUESTS_FAILING}: {failed} of {result.requests} requests failed"
        )
    if result.requests and not result.requests_ok:
        problems.append("no request succeeded")
    if result.aborted:
        problems.append(f"stopped early: {result.aborted}")
    return problems


def judge(
    result: BenchResult, tables: dict[str, dependence.Table | None] | None = None
) -> tuple[Verdict, list[Finding]]:
    """The run's verdict, and the `unexplained_tail` findings to add to its diagnosis (the
    diagnosis must be made first: the verdict reads its findings). `tables`: the run's
    dependence tables when the diagnosis read them."""
    reads = Reads(result.records) if result.records else None
    judged = tails(result, reads.typical_ms if reads is not None and reads.usable else None)
    findings = []
    for tail in judged:
        if tail.state != "bad":
            continue
        _attribute(tail, result.diagnosis)
        already = any(
            f.rule == RULE_UNEXPLAINED_TAIL and f.evidence.get("tail") == tail.metric
            for f in result.diagnosis
        )
        share = tail.unexplained_share
        if share is not None and share >= UNEXPLAINED_MIN_SHARE and not already:
            findings.append(unexplained(result, tail, tables))
    problems = _problems(result)
    bad = [t for t in judged if t.state == "bad"]
    if problems or any(not _the_clients(t) for t in bad):
        state = "unhealthy"
    elif bad or not judged or any(t.state == "not_judged" for t in judged):
        state = "inconclusive"  # the client's tails, or one not judged
    else:
        state = "healthy"
    verdict = Verdict(state=state, tails=judged, problems=problems)
    verdict.line = _line(verdict)
    return verdict, findings


def _the_clients(tail: TailVerdict) -> bool:
    """A bad tail the lab's own client explains, and nothing else: it says nothing of the
    server."""
    explained = tail.explained_by
    unexplained = tail.unexplained_share
    return (
        bool(explained)
        and set(explained) <= CLIENT_RULES
        and (unexplained is None or unexplained < UNEXPLAINED_MIN_SHARE)
    )


def _line(verdict: Verdict) -> str:
    parts = [_tail_words(t) for t in verdict.tails]
    if not verdict.tails:
        parts.append("no output to judge")
    parts += verdict.problems
    if not any(p.startswith(rules.RULE_INTEGRITY_FAULTS) for p in verdict.problems):
        parts.append("output whole")
    return f"{verdict.state}: " + "; ".join(parts)


def _tail_words(tail: TailVerdict) -> str:
    name = TAIL_WORDS[tail.metric]
    if tail.state == "not_judged":
        if not math.isfinite(tail.bound_ms):
            return f"{name} not judged ({tail.bound})"
        least = MIN_GAPS if tail.metric == "itl_ms" else MIN_FIRST_OUTPUTS
        return (
            f"{name} not judged ({tail.values} values, fewer than {least}: p99 "
            f"{tail.value_ms:.1f} ms, p50 {tail.p50_ms:.1f})"
        )
    if tail.state == "healthy":
        return f"{name} p99 {tail.value_ms:.1f} ms within {tail.bound_ms:.1f} ({tail.bound})"
    words = (
        f"{name} p99 {tail.value_ms:.1f} ms over {tail.bound_ms:.1f} ({tail.bound}), "
        f"p50 {tail.p50_ms:.1f}"
    )
    explained, unexplained = cause_words(tail), _unexplained_words(tail)
    if _the_clients(tail):
        words += ": the lab's own client's, not the server's: " + ", ".join(explained)
    elif explained:
        words += ": explained by " + ", ".join(explained)
    if unexplained:
        words += (", " if explained else ": ") + unexplained
    return words


def cause_words(tail: TailVerdict) -> list[str]:
    """A bad tail's causes with their shares where known ("slow_worker 60%")."""
    return [
        rule + (f" {share:.0%}" if share is not None else "")
        for rule, share in tail.explained_by.items()
    ]


def _unexplained_words(tail: TailVerdict) -> str:
    """What of a bad tail is left unexplained ("" under UNEXPLAINED_MIN_SHARE)."""
    share = tail.unexplained_share
    if share is not None and share >= UNEXPLAINED_MIN_SHARE:
        return f"{share:.0%} unexplained ({RULE_UNEXPLAINED_TAIL})"
    return ""


def attribution_words(tail: TailVerdict) -> str:
    """A bad tail's attribution in one phrase: its causes and shares, then what is left."""
    return ", ".join(w for w in (*cause_words(tail), _unexplained_words(tail)) if w)


def unexplained(
    result: BenchResult,
    tail: TailVerdict,
    tables: dict[str, dependence.Table | None] | None = None,
) -> Finding:
    """The `unexplained_tail` finding of a bad tail: how much, when, which streams, what
    coincided, and what evidence would decide it."""
    name = TAIL_WORDS[tail.metric]
    share = tail.unexplained_share if tail.unexplained_share is not None else 1.0
    evidence: dict = {
        "tail": tail.metric,
        f"{name.lower()}_p50_ms": round(tail.p50_ms, 2),
        f"{name.lower()}_p99_ms": round(tail.value_ms, 2),
        f"{name.lower()}_p99_over_p50": round(tail.value_ms / tail.p50_ms, 2)
        if tail.p50_ms > 0
        else None,
        f"{name.lower()}_p99_excess_ms": round(tail.value_ms - tail.p50_ms, 2),
        "healthy_p99_at_most_ms": round(tail.bound_ms, 2),
        "unexplained_share": round(share, 3),
    }
    if tail.metric == "ttft_ms":
        evidence["ttft_p90_ms"] = round(result.ttft_ms.p90, 2)
        evidence["itl_p50_ms"] = round(result.itl_ms.p50, 2)
    records = result.records or []
    where = (
        (
            tail_evidence.slow_gaps(records, tail.bound_ms)
            if tail.metric == "itl_ms"
            else tail_evidence.slow_first_outputs(records, tail.bound_ms)
        )
        if records
        else {}
    )
    evidence.update(where)
    # What the tail was set against and found not to follow (or to follow too weakly).
    table = dependence.table_evidence(records, tail.metric, tables)
    evidence.update(table)
    sentence = _unexplained_sentence(tail, share, where)
    if table:
        sentence += f"; dependence on the run's variables: {table['dependence']}"
    return Finding(
        rule=RULE_UNEXPLAINED_TAIL,
        finding=sentence,
        evidence=evidence,
        look_at=_what_would_decide(result, tail.metric),
        severity=ALARM,
    )


def _unexplained_sentence(tail: TailVerdict, share: float, where: dict) -> str:
    name = TAIL_WORDS[tail.metric]
    head = (
        f"{name} p99 {tail.value_ms:.1f} ms is {tail.value_ms / tail.p50_ms:.1f}x its p50 "
        f"{tail.p50_ms:.1f} ms (healthy: at most {tail.bound_ms:.1f}) and no rule explains "
        f"{share:.0%} of it"
        if tail.p50_ms > 0
        else f"{name} p99 {tail.value_ms:.1f} ms is over {tail.bound_ms:.1f} and no rule "
        f"explains {share:.0%} of it"
    )
    if not where:
        return head + " (no records to say when)"
    if tail.metric == "itl_ms":
        return (
            head + f": {where['slow_gaps']} slow gaps ({where['slow_gap_share']:.1%} of "
            f"{where['gaps']}) in {where['streams_with_slow_gaps']} of {where['streams']} "
            f"streams, at {where['slow_gaps_at_s']} s; "
            f"other streams got output during {where['slow_gaps_others_received_share']:.0%}"
            f" of them (their own delay, not a stall of all), "
            f"{where['streams_started_during_slow_gaps']} streams were sent during them "
            f"(the run's rate of sends would put {where['streams_started_by_chance']:g} "
            "there)"
        )
    return (
        head + f": {where['slow_first_outputs']} of {where['requests_with_output']} "
        f"requests, sent at {where['slow_first_outputs_sent_at_s']} s, with "
        f"{where['open_streams_at_slow_sends_p50']:.0f} streams open at their send (p50; "
        f"{where['open_streams_at_sends_p50']:.0f} for all requests)"
    )


def _what_would_decide(result: BenchResult, metric: str) -> str:
    """The evidence the run lacks that would tell the cause, as options of cadence bench."""
    wanted = []
    if not result.server_threads:
        wanted.append(
            "--server-pid PID (the server's threads and CPU: a busy thread, a "
            "collection pause, threads waiting for a CPU)"
        )
    if not result.scraped:
        wanted.append(
            "--scrape URL (the server's own metrics: requests running and waiting, "
            "the KV cache, its step times)"
        )
    if not result.server_spans:
        wanted.append(
            "--otlp-receive PORT (the server's spans: where each request's time goes inside it)"
        )
    if result.workload.protocol == "cadence" and not result.segments_ms:
        wanted.append(
            "cadence's server timing (drop --no-timing): each chunk's engine step and path"
        )
    what = (
        "the slow gaps' timestamps against the server's own record of those instants"
        if metric == "itl_ms"
        else "where the slow first outputs waited: a queue, a pool, a stream limit or prefill"
    )
    if not wanted:
        return f"{what}; the run had every source the lab reads: see the server's own logs"
    return f"{what}; rerun with " + "; ".join(wanted)

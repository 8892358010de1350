"""Read a bench result and say where the time goes, with evidence.

`diagnose(result)` takes what `cadence.lab.bench.run_bench` returns and gives its findings
(`cadence.lab.results.Finding`): the rule's name, one sentence, the numbers that made it fire
(ms, shares 0..1, % of one core) and what to look at.

Each rule is a `Rule` in the module of its family, with its thresholds beside it and the
rules it gives way to (a finding another rule's finding explains is dropped):

- `health`: requests_failing
- `integrity`: integrity_faults, usage_above_events (tokens lost, repeated, reordered; streams
  ended short; SSE events beyond the server's usage; information: usage above the events)
- `connection`: server_stream_limit, slow_connect
- `ttft`: ttft_engine_start, ttft_queueing
- `itl`: itl_unstable_engine, itl_unstable_network_side, slow_reader
- `host`: front_cpu_bound, cpu_busy_cards_idle
- `contention`: host_contended (other work filled the host)
- `client`: client_saturated, client_behind_schedule
- `client_reads`: client_read_late (the lab's own client stamped slow reads late)
- `arrivals`: arrivals_stall_streams (new requests hold the running streams)
- `streams`: streams_stall_together, ttft_grows_with_streams, front_loop_blocked
- `workers`: slow_worker
- `disaggregation`: prefill_pool_bottleneck, decode_pool_bottleneck (a disaggregated
  server's prefill or decode workers hold the run back)
- `shape`: output_held_back, slow_stream_group, slow_first_message
- `batching`: prefill_stalls_decode, one_stream_at_a_time
- `timers`: gaps_at_fixed_values
- `threads`: server_one_core_bound, server_threads_wait_for_cpu (the server's threads, read
  from /proc on this host)
- `scraped`: kv_cache_full, server_queue_grows (the server's own metrics, `--scrape`)
- `capacity`: under_capacity (only when nothing else is wrong)
- `spans`: ttft_before_server, ttft_after_server, ttft_server_queue (the server's spans,
  `--otlp-receive`)
- `dependence`: itl_depends_on, ttft_depends_on (what the gaps and the first outputs
  follow: a variable of the run, with the shape and size of the dependence)

tests/unit/lab/test_diagnosis_docstring.py checks that this list names every rule of `RULES`.

The client-side rules on the streams' shape share one reading of the raw records
(`coincidence`): the tail time of the slow gaps and slow first outputs, attributed to the
causes whose signatures coincide with each (`signatures`), so that each finding says its
share of the tail and overlapping causes split it.

A rule fires only on evidence in the data. Where the data a rule needs is absent (a run
without server timing has no segments; a remote target has no process samples; a machine
without NVML has no cards), the rule stays silent rather than guess. The thresholds are set
so that a run on a busy 2-core machine (clients, front, workers and someone else's benchmark
sharing the cores) does not trip them, while a planted bottleneck (a slow first step, step
jitter, a slow reader) does with room to spare.
"""

from __future__ import annotations

from msgspec import UNSET

from cadence.lab.analysis.diagnosis import (
    arrivals,
    batching,
    capacity,
    client,
    client_reads,
    connection,
    contention,
    dependence,
    disaggregation,
    health,
    host,
    integrity,
    itl,
    scraped,
    shape,
    spans,
    streams,
    threads,
    timers,
    ttft,
    workers,
)
from cadence.lab.analysis.diagnosis.arrivals import ARRIVALS_MIN_SHARE
from cadence.lab.analysis.diagnosis.capacity import UNDER_CAPACITY_BATCH
from cadence.lab.analysis.diagnosis.client import CLIENT_BUSY_SHARE
from cadence.lab.analysis.diagnosis.client_reads import CLIENT_LATE_MIN_SHARE
from cadence.lab.analysis.diagnosis.connection import CONNECT_TTFT_SHARE, SLOW_CONNECT_MS
from cadence.lab.analysis.diagnosis.disaggregation import (
    DECODE_STEP_GROWTH,
    DECODE_STEP_GROWTH_MIN_MS,
    HANDOFF_WAIT_MIN_MS,
    HANDOFF_WAIT_STEPS,
    POOL_BUSY_SHARE,
    PREFILL_TTFT_TAIL_SHARE,
)
from cadence.lab.analysis.diagnosis.facts import (
    ENGINE_UNSTABLE_MIN_MS,
    ENGINE_UNSTABLE_P90_RATIO,
    MIN_CPU_SAMPLES,
    OTHERS_MIN_PCT,
    RunFacts,
)
from cadence.lab.analysis.diagnosis.health import FAILING_SHARE
from cadence.lab.analysis.diagnosis.host import BUSY_CPU_PCT, IDLE_CARD_PCT
from cadence.lab.analysis.diagnosis.itl import (
    ENGINE_SIDE_SHARE,
    ITL_MIN_SPREAD_MS,
    ITL_UNEVEN_P90_RATIO,
    MERGE_BUFFER_STEPS,
    MERGED_CHUNK_TOKENS,
    NETWORK_UNSTABLE_P90_RATIO,
    SIDE_SHARE,
    SLOW_READER_ITL_FACTOR,
    SLOW_READER_PATH_SHARE,
)
from cadence.lab.analysis.diagnosis.names import (
    RULE_ARRIVALS_STALL_STREAMS,
    RULE_CLIENT_BEHIND_SCHEDULE,
    RULE_CLIENT_READ_LATE,
    RULE_CLIENT_SATURATED,
    RULE_CPU_BUSY_CARDS_IDLE,
    RULE_DECODE_POOL_BOTTLENECK,
    RULE_FRONT_CPU_BOUND,
    RULE_FRONT_LOOP_BLOCKED,
    RULE_HOST_CONTENDED,
    RULE_INTEGRITY_FAULTS,
    RULE_ITL_UNSTABLE_ENGINE,
    RULE_ITL_UNSTABLE_NETWORK,
    RULE_KV_CACHE_FULL,
    RULE_ONE_STREAM_AT_A_TIME,
    RULE_OUTPUT_HELD_BACK,
    RULE_PREFILL_POOL_BOTTLENECK,
    RULE_PREFILL_STALLS_DECODE,
    RULE_REQUESTS_FAILING,
    RULE_SERVER_ONE_CORE_BOUND,
    RULE_SERVER_QUEUE_GROWS,
    RULE_SERVER_STREAM_LIMIT,
    RULE_SERVER_THREADS_WAIT_FOR_CPU,
    RULE_SLOW_CONNECT,
    RULE_SLOW_FIRST_MESSAGE,
    RULE_SLOW_READER,
    RULE_SLOW_STREAM_GROUP,
    RULE_SLOW_WORKER,
    RULE_STREAMS_STALL_TOGETHER,
    RULE_TTFT_AFTER_SERVER,
    RULE_TTFT_BEFORE_SERVER,
    RULE_TTFT_ENGINE_START,
    RULE_TTFT_GROWS_WITH_STREAMS,
    RULE_TTFT_QUEUEING,
    RULE_TTFT_SERVER_QUEUE,
    RULE_UNDER_CAPACITY,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.analysis.diagnosis.streams import (
    CAP_RECEIVING_SHARE,
    CAP_TIME_SHARE,
    GAPS_NORMAL_RATIO,
    LOOP_GAP_TAIL_MS,
    LOOP_LATE_MIN,
    LOOP_LATE_SHARE,
    SHARED_LONG_GAP_SHARE,
    SHARED_STALLS_MIN,
    SHARED_TIME_SHARE,
    TTFT_GROWTH_GAPS,
    TTFT_GROWTH_MIN_MS,
)
from cadence.lab.analysis.diagnosis.ttft import (
    FIRST_STEP_SHARE,
    STARTUP_MIN_MS,
    STARTUP_STEP_FACTOR,
    STARTUP_TTFT_SHARE,
    TTFT_HIGH_MIN_MS,
    TTFT_HIGH_STEPS,
    WAIT_SHARE,
)
from cadence.lab.analysis.diagnosis.workers import (
    SLOW_WORKER_BATCH_RATIO,
    SLOW_WORKER_ITL_RATIO,
    SLOW_WORKER_MIN_MS,
    SLOW_WORKER_RATIO,
)
from cadence.lab.results import ALARM, BenchResult, Finding

RULES: tuple[Rule, ...] = (
    *health.RULES,
    *integrity.RULES,
    *connection.RULES,
    *ttft.RULES,
    *itl.RULES,
    *host.RULES,
    *client.RULES,
    *client_reads.RULES,
    *arrivals.RULES,
    *streams.RULES,
    *workers.RULES,
    *disaggregation.RULES,
    *shape.RULES,
    *batching.RULES,
    *timers.RULES,
    *threads.RULES,
    *contention.RULES,
    *scraped.RULES,
    *capacity.RULES,
    *spans.RULES,
    *dependence.RULES,
)
"""Every rule, in the order their findings are listed."""


def diagnose(result: BenchResult, facts: RunFacts | None = None) -> list[Finding]:
    """The findings for a bench result, in rule order; empty when no rule fired. `facts`:
    the result's facts when the caller reads them too (they are computed once)."""
    facts = facts if facts is not None else RunFacts(result)
    found = [(rule, f) for rule in RULES for f in rule.check(facts)]
    fired = {f.rule for _, f in found}
    for _, f in found:
        if f.severity is UNSET:
            f.severity = ALARM
    return [
        f
        for rule, f in found
        if not any(way.to in fired and way.when(f, facts) for way in rule.gives_way_to)
    ]


__all__ = [
    "ARRIVALS_MIN_SHARE",
    "BUSY_CPU_PCT",
    "CAP_RECEIVING_SHARE",
    "CAP_TIME_SHARE",
    "CLIENT_BUSY_SHARE",
    "CLIENT_LATE_MIN_SHARE",
    "CONNECT_TTFT_SHARE",
    "DECODE_STEP_GROWTH",
    "DECODE_STEP_GROWTH_MIN_MS",
    "ENGINE_SIDE_SHARE",
    "ENGINE_UNSTABLE_MIN_MS",
    "ENGINE_UNSTABLE_P90_RATIO",
    "FAILING_SHARE",
    "FIRST_STEP_SHARE",
    "GAPS_NORMAL_RATIO",
    "HANDOFF_WAIT_MIN_MS",
    "HANDOFF_WAIT_STEPS",
    "IDLE_CARD_PCT",
    "ITL_MIN_SPREAD_MS",
    "ITL_UNEVEN_P90_RATIO",
    "LOOP_GAP_TAIL_MS",
    "LOOP_LATE_MIN",
    "LOOP_LATE_SHARE",
    "MERGED_CHUNK_TOKENS",
    "MERGE_BUFFER_STEPS",
    "MIN_CPU_SAMPLES",
    "NETWORK_UNSTABLE_P90_RATIO",
    "OTHERS_MIN_PCT",
    "POOL_BUSY_SHARE",
    "PREFILL_TTFT_TAIL_SHARE",
    "RULES",
    "RULE_ARRIVALS_STALL_STREAMS",
    "RULE_CLIENT_BEHIND_SCHEDULE",
    "RULE_CLIENT_READ_LATE",
    "RULE_CLIENT_SATURATED",
    "RULE_CPU_BUSY_CARDS_IDLE",
    "RULE_DECODE_POOL_BOTTLENECK",
    "RULE_FRONT_CPU_BOUND",
    "RULE_FRONT_LOOP_BLOCKED",
    "RULE_HOST_CONTENDED",
    "RULE_INTEGRITY_FAULTS",
    "RULE_ITL_UNSTABLE_ENGINE",
    "RULE_ITL_UNSTABLE_NETWORK",
    "RULE_KV_CACHE_FULL",
    "RULE_ONE_STREAM_AT_A_TIME",
    "RULE_OUTPUT_HELD_BACK",
    "RULE_PREFILL_POOL_BOTTLENECK",
    "RULE_PREFILL_STALLS_DECODE",
    "RULE_REQUESTS_FAILING",
    "RULE_SERVER_ONE_CORE_BOUND",
    "RULE_SERVER_QUEUE_GROWS",
    "RULE_SERVER_STREAM_LIMIT",
    "RULE_SERVER_THREADS_WAIT_FOR_CPU",
    "RULE_SLOW_CONNECT",
    "RULE_SLOW_FIRST_MESSAGE",
    "RULE_SLOW_READER",
    "RULE_SLOW_STREAM_GROUP",
    "RULE_SLOW_WORKER",
    "RULE_STREAMS_STALL_TOGETHER",
    "RULE_TTFT_AFTER_SERVER",
    "RULE_TTFT_BEFORE_SERVER",
    "RULE_TTFT_ENGINE_START",
    "RULE_TTFT_GROWS_WITH_STREAMS",
    "RULE_TTFT_QUEUEING",
    "RULE_TTFT_SERVER_QUEUE",
    "RULE_UNDER_CAPACITY",
    "SHARED_LONG_GAP_SHARE",
    "SHARED_STALLS_MIN",
    "SHARED_TIME_SHARE",
    "SIDE_SHARE",
    "SLOW_CONNECT_MS",
    "SLOW_READER_ITL_FACTOR",
    "SLOW_READER_PATH_SHARE",
    "SLOW_WORKER_BATCH_RATIO",
    "SLOW_WORKER_ITL_RATIO",
    "SLOW_WORKER_MIN_MS",
    "SLOW_WORKER_RATIO",
    "STARTUP_MIN_MS",
    "STARTUP_STEP_FACTOR",
    "STARTUP_TTFT_SHARE",
    "TTFT_GROWTH_GAPS",
    "TTFT_GROWTH_MIN_MS",
    "TTFT_HIGH_MIN_MS",
    "TTFT_HIGH_STEPS",
    "UNDER_CAPACITY_BATCH",
    "WAIT_SHARE",
    "Finding",
    "GiveWay",
    "Rule",
    "RunFacts",
    "diagnose",
]

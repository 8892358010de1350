"""Point S12 of the design: read a bench result and say where the time goes, with evidence.

`diagnose(result)` takes what `cadence.lab.bench.run_bench` returns and gives a list of
findings, each a dict:

- ``rule``: a short id (the ``RULE_*`` constants below);
- ``finding``: one sentence;
- ``evidence``: the numbers that made the rule fire (ms, shares 0..1, % of one core);
- ``look_at``: what to check or change.

A rule fires only on evidence in the data. Where the data a rule needs is absent (a run
without server timing has no segments; a remote target has no process samples; a machine
without NVML has no cards), the rule stays silent rather than guess.

The yardstick for "high" and "unstable" is the run's own engine step (the p50 of the
``engine_step`` segment), not a fixed number of milliseconds: the same thresholds then hold
for a 5 ms synthetic step and a 40 ms step on a card. Every threshold is a module constant
with the reason for its value; they are set so that a run on a busy 2-core machine (clients,
front, workers and someone else's benchmark sharing the cores) does not trip them, while a
planted bottleneck (a slow first step, step jitter, a slow reader) does with room to spare.
Aggregates are defined in `cadence.lab.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cadence.lab.analysis.timeline import MIN_BURST

RULE_TTFT_ENGINE_START = "ttft_engine_start"
RULE_TTFT_QUEUEING = "ttft_queueing"
RULE_ITL_UNSTABLE_NETWORK = "itl_unstable_network_side"
RULE_ITL_UNSTABLE_ENGINE = "itl_unstable_engine"
RULE_FRONT_CPU_BOUND = "front_cpu_bound"
RULE_CLIENT_SATURATED = "client_saturated"
RULE_UNDER_CAPACITY = "under_capacity"
RULE_SLOW_READER = "slow_reader"
RULE_CPU_BUSY_CARDS_IDLE = "cpu_busy_cards_idle"
RULE_STREAMS_STALL_TOGETHER = "streams_stall_together"
RULE_TTFT_GROWS_WITH_STREAMS = "ttft_grows_with_streams"
RULE_FRONT_LOOP_BLOCKED = "front_loop_blocked"
RULE_SLOW_WORKER = "slow_worker"

# -- thresholds -----------------------------------------------------------------------------

TTFT_HIGH_STEPS = 5.0
"""TTFT is "high" from this many typical engine steps. A request normally waits for the
step in flight (up to one step), then its own step, plus the trip through the front: 1.5-4.5
steps measured on a 2-core machine with 1-64 streams opened at once, idle or running another
benchmark."""

TTFT_HIGH_MIN_MS = 100.0
"""...and from this many ms at least: opening 16-64 streams at once costs the client and the
front 10-70 ms on a 2-core machine shared with another benchmark, whatever the step; with a
5 ms step that is already 5-14 steps."""

STARTUP_STEP_FACTOR = 5.0
"""A step is a start-up stall when it takes this many times the p90 of the run's steps.
Jitter puts single steps near 3x the p90 even at a standard deviation of 80 % of the step;
loading a model, compiling kernels or warming a card costs 10-100 steps."""

STARTUP_MIN_MS = 20.0
"""...and at least this many ms more than the p90 step: with sub-millisecond steps a
scheduler hiccup of a few ms would otherwise look like a 10x stall."""

STARTUP_TTFT_SHARE = 0.5
"""The stall explains the TTFT tail when it is at least this share of TTFT p99, and shows
in it when TTFT p99 is at least this share of the stall (the requests waited for it)."""

FIRST_STEP_SHARE = 0.5
"""TTFT is "mostly" the admitting step (first_step) from this share of its mean."""

WAIT_SHARE = 0.5
"""TTFT is "mostly" waiting (client_to_front + queue, less a start-up stall) from this share."""

ITL_UNEVEN_P90_RATIO = 1.3
"""ITL is uneven from this p90/p50 (idle steady runs: 1.1-1.2); the engine rule needs no
more, because the engine's own steps must vary as well (ENGINE_UNSTABLE_*), which a busy
machine does not fake. Jitter with a standard deviation of 80 % of the step gives 1.75-2.7
(the low end when a busy machine also stretches the p50). The rules read the p90, not the
p99: in a short run one stall of a process (100 ms when two benchmarks share 2 cores) delays
every open stream's gap at once, 16 of 800 gaps, and moves the p99 alone."""

ENGINE_UNSTABLE_P90_RATIO = 1.5
ENGINE_UNSTABLE_MIN_MS = 6.0
"""The engine's steps vary when the engine_step segment's p90 is this many times its p50 and
this many ms above it. Late wake-ups on a busy machine stretch steps by a few ms whatever
their length: synthetic steps measure p90/p50 of 1.0-1.05 on an idle 2-core machine and, with
another benchmark on the same cores, up to 1.4 for 10 ms steps and 1.85 for 5 ms steps, at
most 4.5 ms above the p50. Jitter with a standard deviation of 80 % of a 10 ms step gives
1.9-2.5, 9-15 ms above the p50."""

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
"""...and on the engine, whose steps must vary themselves (ENGINE_UNSTABLE_*), from this
share: jitter gives the engine 0.5-0.9 of the spread even on a busy machine, where late
deliveries add to the other side. Both sides are named when both hold."""

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

BUSY_CPU_PCT = 80.0
"""A process is near one core from this % of a core, averaged over the run (as the sampler's
own S10 flag). The front's event loop runs on one thread; above 80 % its queue builds up."""

CLIENT_BUSY_SHARE = 0.8
"""A load-generating process spending this share of its wall time on CPU measures itself
(the threshold `print_summary` already uses)."""

MIN_CPU_SAMPLES = 3
"""CPU readings come every 0.1 s with ~10 % resolution each; fewer than this many inside the
run are not evidence."""

UNDER_CAPACITY_BATCH = 4.0
"""Throughput is under capacity when each worker makes fewer than this many tokens per
engine step on average (tokens/s x step / workers): a decode step costs about the same for
1 or 8 sequences, so most of each step is wasted."""

# Client-side evidence only (runs without server timing, e.g. any gRPC service): what the
# streams' arrival times show together (`cadence.lab.timeline`).

SHARED_STALLS_MIN = 3
"""Stalls that hit every open stream at once count from this many: one or two are what a
busy 2-core machine gives a run now and then (a process descheduled for ~100 ms)."""

SHARED_TIME_SHARE = 0.05
"""...and when they hold at least this share of the run: a server pausing 100 ms every
0.5 s stalls 20 % of it; machine hiccups stay near 1-2 %."""

SHARED_LONG_GAP_SHARE = 0.5
"""...and when at least this share of the streams' long gaps fall inside them (the rest are
single streams' own stalls)."""

TTFT_GROWTH_GAPS = 5.0
TTFT_GROWTH_MIN_MS = 50.0
"""TTFT "grows" when the requests opened at once are served over a spread (p90 - p10 within
the largest burst) of this many typical gaps and this many ms at least: a healthy server
starts a burst within one or two steps; one that takes calls in one at a time, or runs one
thread per stream, serves the last of 32 streams hundreds of ms after the first."""

CAP_RECEIVING_SHARE = 0.8
CAP_TIME_SHARE = 0.5
"""A hard cap on streams: at most this share of the open streams ever received output at
once, and the receiving count sat at its peak, with streams waiting, for at least this share
of the run. A server that is merely slow to start streams (a long prefill) lets the
receiving count wander below its peak instead of holding it."""

GAPS_NORMAL_RATIO = 2.5
"""...while the gaps stay normal: chunk-gap p90 within this many times its p50 (as
NETWORK_UNSTABLE_P90_RATIO: below it a busy machine is not told apart from uneven delivery)."""

LOOP_LATE_SHARE = 0.05
LOOP_LATE_MIN = 3
"""The front's loop is blocked when at least this share of its heartbeat wake-ups (one per
0.1 s) came more than 20 ms late, and at least this many: a busy but healthy front (256
streams of 10 ms steps on a 2-core machine) was late in 1 of 12; user code that blocks the
loop for 60 ms every 0.3 s makes about 13% of them late, 100 ms every second 8%."""

LOOP_GAP_TAIL_MS = 20.0
"""...and when the gaps have a tail it can explain: chunk-gap p99 this many ms above p50
(a blocked loop delays the next chunk of every stream by the time it was blocked)."""

SLOW_WORKER_RATIO = 1.5
SLOW_WORKER_MIN_MS = 3.0
"""A worker's steps are much slower than the others' when its step p50 is this many times
the median of theirs and this many ms above it (a busy 2-core host moves one worker's steps
by up to 1.4x for 10 ms steps; a card at a third of the others' speed gives 3x)."""

SLOW_WORKER_BATCH_RATIO = 2.0
"""...at a comparable batch: its sequences per step within this factor of the others'
(a step carrying four times the sequences may rightly take longer)."""

SLOW_WORKER_ITL_RATIO = 1.3
"""...and its streams are the slow ones: their ITL p50 this many times the other streams'."""

# -- reading the result -----------------------------------------------------------------------

Finding = dict


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _dist(result: dict, *path: str) -> dict | None:
    """The distribution at `path` if it has values, else None."""
    d = result
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    if not isinstance(d, dict) or not d.get("count"):
        return None
    if not all(_finite(d.get(k)) for k in ("mean", "p50", "p90", "p99", "max")):
        return None
    return d


def _share(result: dict, kind: str, name: str) -> float | None:
    value = (result.get("segment_shares") or {}).get(kind, {}).get(name)
    return value if _finite(value) else None


def _r(x: float, digits: int = 2) -> float:
    return round(float(x), digits)


def _active_cpu(result: dict, name: str) -> float | None:
    """Mean CPU % of process `name` while the run was going, or None without enough samples.

    The sampler starts before the client processes start, import and connect (a second or
    more on a small machine) and stops right after the last record, so the run is the last
    `wall_s` seconds of the samples; the means the sampler reports include that idle start.
    A sample at t covers the interval before t; it counts when most of that is in the run.
    """
    system = result.get("system") or {}
    process = (system.get("processes") or {}).get(name) or {}
    samples = process.get("samples") or []
    wall_s = result.get("wall_s")
    interval = system.get("interval_s")
    interval = interval if _finite(interval) and interval > 0 else 0.1
    if not samples or not _finite(wall_s) or wall_s <= 0:
        return None
    start = samples[-1][0] - wall_s
    inside = [pct for t, pct in samples if t - interval / 2 >= start and _finite(pct)]
    if len(inside) < MIN_CPU_SAMPLES:
        return None
    return sum(inside) / len(inside)


class _Run:
    """The numbers several rules share, read once."""

    def __init__(self, result: dict) -> None:
        self.result = result
        self.ttft = _dist(result, "ttft_ms")
        self.itl = _dist(result, "itl_ms")
        self.step = _dist(result, "segments_ms", "engine_step")
        self.delay = _dist(result, "token_delay_ms")
        self.first_step = _dist(result, "ttft_segments_ms", "first_step")
        processes = (result.get("system") or {}).get("processes") or {}
        self.workers = sorted(n for n in processes
                              if n.startswith("worker") and ".rank" not in n)
        self.stall_ms = self._stall()

    @property
    def typical_step(self) -> float | None:
        if self.step and self.step["p50"] > 0:
            return self.step["p50"]
        return None

    def _stall(self) -> float | None:
        """The longest admitting step when it is a start-up stall (see STARTUP_*), else None."""
        if not (self.step and self.first_step and self.typical_step):
            return None
        longest, tail = self.first_step["max"], self.step["p90"]
        if longest >= STARTUP_STEP_FACTOR * tail and longest - tail >= STARTUP_MIN_MS:
            return longest
        return None

    def itl_uneven(self, ratio: float) -> bool:
        itl = self.itl
        if not itl or itl["p50"] <= 0:
            return False
        return itl["p90"] >= ratio * itl["p50"] and itl["p90"] - itl["p50"] >= ITL_MIN_SPREAD_MS


# -- rules ------------------------------------------------------------------------------------


def _ttft_engine_start(run: _Run) -> list[Finding]:
    ttft, step, first = run.ttft, run.step, run.first_step
    if not (ttft and step and first and run.typical_step):
        return []
    typical = run.typical_step
    evidence = {
        "ttft_p50_ms": _r(ttft["p50"]),
        "ttft_p99_ms": _r(ttft["p99"]),
        "first_step_mean_ms": _r(first["mean"]),
        "first_step_max_ms": _r(first["max"]),
        "engine_step_p50_ms": _r(typical),
        "engine_step_p90_ms": _r(step["p90"]),
    }
    look_at = ("engine start-up: model load, kernel compilation or warm-up, or the first card's "
               "scheduling (not the serving layer's threads); warm each worker up before "
               "serving or measure with --warmup")
    stall = run.stall_ms
    if (stall is not None and stall >= STARTUP_TTFT_SHARE * ttft["p99"]
            and ttft["p99"] >= STARTUP_TTFT_SHARE * stall):
        queue = _dist(run.result, "segments_ms", "queue")
        if queue:
            evidence["queue_p50_ms"] = _r(queue["p50"])
        evidence["stall_over_step_p90"] = _r(stall / step["p90"], 1)
        return [{
            "rule": RULE_TTFT_ENGINE_START,
            "finding": (f"TTFT is high (p99 {ttft['p99']:.0f} ms) because an engine step that "
                        f"admitted requests took {stall:.0f} ms, {stall / step['p90']:.0f}x a "
                        "typical step; requests that arrived meanwhile queued behind it"),
            "evidence": evidence,
            "look_at": look_at,
        }]
    share = _share(run.result, "ttft", "first_step")
    if (share is not None and share >= FIRST_STEP_SHARE
            and first["mean"] >= STARTUP_STEP_FACTOR * typical
            and ttft["p50"] >= max(TTFT_HIGH_STEPS * typical, TTFT_HIGH_MIN_MS)):
        evidence["ttft_share_first_step"] = _r(share, 3)
        return [{
            "rule": RULE_TTFT_ENGINE_START,
            "finding": (f"TTFT is high (p50 {ttft['p50']:.0f} ms) and {share:.0%} of it is the "
                        f"step that admits a request ({first['mean']:.0f} ms on average, a typical "
                        f"step {typical:.1f} ms)"),
            "evidence": evidence,
            "look_at": look_at + "; or the prefill cost of long prompts",
        }]
    return []


def _ttft_queueing(run: _Run) -> list[Finding]:
    ttft, typical = run.ttft, run.typical_step
    to_front = _dist(run.result, "ttft_segments_ms", "client_to_front")
    queue = _dist(run.result, "ttft_segments_ms", "queue")
    if not (ttft and typical and to_front and queue and ttft["mean"] > 0):
        return []
    if ttft["p50"] < max(TTFT_HIGH_STEPS * typical, TTFT_HIGH_MIN_MS):
        return []
    # Time spent waiting for a start-up stall is the stall's, not a backlog's.
    explained = run.stall_ms or 0.0
    wait = max(0.0, to_front["mean"] + queue["mean"] - explained)
    if wait < WAIT_SHARE * ttft["mean"]:
        return []
    evidence = {
        "ttft_p50_ms": _r(ttft["p50"]),
        "ttft_mean_ms": _r(ttft["mean"]),
        "client_to_front_mean_ms": _r(to_front["mean"]),
        "queue_mean_ms": _r(queue["mean"]),
        "engine_step_p50_ms": _r(typical),
        "wait_share": _r(wait / ttft["mean"], 3),
    }
    if explained:
        evidence["startup_stall_ms"] = _r(explained)
    if queue["mean"] >= to_front["mean"]:
        where = "waiting for a worker to admit it (queue)"
        look_at = ("scheduling backlog: the workers' batches are full or busy; add workers, "
                   "raise --max-batch, or lower the concurrency")
    else:
        where = "reaching the front (client_to_front)"
        look_at = ("admission backlog: the front (or the client) is slow to accept new streams; "
                   "check front and client CPU, open streams more gradually or lower the "
                   "concurrency, add front or client processes")
    return [{
        "rule": RULE_TTFT_QUEUEING,
        "finding": (f"TTFT is high (p50 {ttft['p50']:.0f} ms, {ttft['p50'] / typical:.0f} engine "
                    f"steps) and {wait / ttft['mean']:.0%} of it is spent {where}"),
        "evidence": evidence,
        "look_at": look_at,
    }]


def _itl_unstable(run: _Run) -> list[Finding]:
    itl, step, delay = run.itl, run.step, run.delay
    if not (itl and step and delay and run.typical_step and run.itl_uneven(ITL_UNEVEN_P90_RATIO)):
        return []
    engine_spread = max(0.0, step["p90"] - step["p50"])
    path_spread = max(0.0, delay["p90"] - delay["p50"])
    total = engine_spread + path_spread
    if total <= 0:
        return []
    evidence = {
        "itl_p50_ms": _r(itl["p50"]),
        "itl_p90_ms": _r(itl["p90"]),
        "itl_p99_ms": _r(itl["p99"]),
        "engine_step_p50_ms": _r(step["p50"]),
        "engine_step_p90_ms": _r(step["p90"]),
        "token_delay_p50_ms": _r(delay["p50"]),
        "token_delay_p90_ms": _r(delay["p90"]),
        "engine_share_of_spread": _r(engine_spread / total, 3),
    }
    findings = []
    if (engine_spread >= ENGINE_SIDE_SHARE * total
            and step["p90"] >= ENGINE_UNSTABLE_P90_RATIO * step["p50"]
            and engine_spread >= ENGINE_UNSTABLE_MIN_MS):
        findings.append({
            "rule": RULE_ITL_UNSTABLE_ENGINE,
            "finding": (f"ITL is unstable (p90 {itl['p90']:.1f} ms vs p50 {itl['p50']:.1f} ms) "
                        f"and the engine's steps vary as much (p90 {step['p90']:.1f} ms vs p50 "
                        f"{step['p50']:.1f} ms): the engine jitters, not the serving layer"),
            "evidence": evidence,
            "look_at": ("the engine's step time: batch composition (prefill in decode steps), "
                        "host-side work in the step, other jobs on the card, clock throttling, "
                        "or a host CPU too busy to run the worker on time"),
        })
    if path_spread >= SIDE_SHARE * total and run.itl_uneven(NETWORK_UNSTABLE_P90_RATIO):
        segments = run.result.get("segments_ms") or {}
        spreads = {
            name: segments[name]["p90"] - segments[name]["p50"]
            for name in ("transfer", "buffer", "send")
            if _dist(run.result, "segments_ms", name)
        }
        worst = max(spreads, key=spreads.get) if spreads else "send"
        # The front's own event-loop lag (when the server exports it): a loop late by more than
        # 20 ms in many samples says the front itself is blocked or saturated.
        loop = ((run.result.get("system") or {}).get("server_metrics") or {}).get("front_loop")
        loop_evidence = ({"front_loop_samples": loop["samples"],
                          "front_loop_late_over_20ms": loop["late_over_20ms"]}
                         if loop and loop["samples"] else {})
        findings.append({
            "rule": RULE_ITL_UNSTABLE_NETWORK,
            "finding": (f"ITL is unstable (p90 {itl['p90']:.1f} ms vs p50 {itl['p50']:.1f} ms) and "
                        f"the extra time is on the way from the step to the client, mostly in "
                        f"{worst}, not in the engine's steps"),
            "evidence": {**evidence, **{f"{n}_spread_ms": _r(v) for n, v in spreads.items()},
                         **loop_evidence},
            "look_at": ("backlog on the network side: slow clients, HTTP/2 flow control, a blocked "
                        "front event loop (front CPU), the output reader falling behind"),
        })
    return findings


def _slow_reader(run: _Run) -> list[Finding]:
    itl, typical = run.itl, run.typical_step
    tokens = _dist(run.result, "chunk_tokens")
    buffer = _dist(run.result, "segments_ms", "buffer")
    if not (itl and typical and tokens and buffer):
        return []
    path_share = sum(_share(run.result, "token", n) or 0.0 for n in ("buffer", "send"))
    merging = tokens["mean"] >= MERGED_CHUNK_TOKENS and buffer["p50"] >= MERGE_BUFFER_STEPS * typical
    lagging = (itl["p50"] >= SLOW_READER_ITL_FACTOR * typical
               and path_share >= SLOW_READER_PATH_SHARE)
    if not (merging or lagging):
        return []
    evidence = {
        "itl_p50_ms": _r(itl["p50"]),
        "engine_step_p50_ms": _r(typical),
        "chunk_tokens_mean": _r(tokens["mean"]),
        "buffer_p50_ms": _r(buffer["p50"]),
        "token_share_buffer_send": _r(path_share, 3),
    }
    if run.delay:
        evidence["token_delay_p50_ms"] = _r(run.delay["p50"])
    scraped = ((run.result.get("system") or {}).get("server_metrics") or {}).get("during_run")
    for name in ("cadence_merged_steps_total", "cadence_buffer_overflows_total"):
        if scraped and _finite(scraped.get(name)):
            evidence[name.removeprefix("cadence_")] = _r(scraped[name], 0)
    if merging:
        finding = (f"tokens reach the clients slower than the engine makes them: chunks carry "
                   f"{tokens['mean']:.1f} tokens on average and a chunk's first token waits "
                   f"{buffer['p50']:.1f} ms in the front's buffer (merging is in effect)")
    else:
        finding = (f"clients read slower than tokens come: a token every {itl['p50']:.1f} ms "
                   f"reaches them against an engine step of {typical:.1f} ms, and "
                   f"{path_share:.0%} of a token's path is after the front (buffer + send)")
    return [{
        "rule": RULE_SLOW_READER,
        "finding": finding,
        "evidence": evidence,
        "look_at": ("the clients' read loop (work per chunk, --read-delay-ms), their CPU and "
                    "network, or a front too busy to send (front_cpu_bound); --queue-capacity "
                    "and --overflow decide whether the server merges tokens or ends the stream"),
    }]


def _fronts(result: dict) -> list[str]:
    """The sampled front processes: "front" (one front), or "front0", "front1", ... with
    `--fronts N`, in front order."""
    processes = (result.get("system") or {}).get("processes") or {}
    names = [n for n in processes if n == "front" or (n.startswith("front") and n[5:].isdigit())]
    return sorted(names, key=lambda n: int(n[5:] or 0))


def _front_cpu_bound(run: _Run) -> list[Finding]:
    # Each front's event loop is one thread: with `--fronts N` any one of them near a core
    # is a bottleneck for its own connections, however idle the others are.
    cpu = {name: _active_cpu(run.result, name) for name in _fronts(run.result)}
    cpu = {name: pct for name, pct in cpu.items() if pct is not None}
    busy = [name for name, pct in cpu.items() if pct >= BUSY_CPU_PCT]
    if not busy:
        return []
    evidence = {f"{name}_cpu_pct": _r(pct, 1) for name, pct in cpu.items()}
    if _finite(run.result.get("chunks_per_s")):
        evidence["chunks_per_s"] = _r(run.result["chunks_per_s"], 0)
    look_at = ("more front processes, fewer chunks (let tokens merge, larger steps), less "
               "work per chunk in the front (timing, text decoding)")
    if list(cpu) == ["front"]:
        finding = (f"the front used {cpu['front']:.0f}% of a core during the run: it is the "
                   "bottleneck")
    else:
        pct = max(cpu[name] for name in busy)
        finding = (f"{' and '.join(busy)} of {len(cpu)} fronts used up to {pct:.0f}% of a core "
                   "during the run: a busy front is the bottleneck for its connections")
        if len(busy) < len(cpu):
            look_at += ("; the kernel spreads connections, not streams, over the fronts: more "
                        "client connections (--channels, --procs) even them out")
    return [{
        "rule": RULE_FRONT_CPU_BOUND,
        "finding": finding,
        "evidence": evidence,
        "look_at": look_at,
    }]


def _client_saturated(run: _Run) -> list[Finding]:
    client = run.result.get("client") or {}
    share = client.get("busiest_process_cpu_share")
    evidence: dict = {}
    if _finite(share) and share >= CLIENT_BUSY_SHARE:
        evidence["busiest_process_cpu_share"] = _r(share, 3)
    processes = (run.result.get("system") or {}).get("processes") or {}
    for name in sorted(n for n in processes if n.startswith("client")):
        pct = _active_cpu(run.result, name)
        if pct is not None and pct >= BUSY_CPU_PCT:
            evidence[f"{name}_cpu_pct"] = _r(pct, 1)
    if not evidence:
        return []
    if _finite(client.get("cpu_per_chunk_us")):
        evidence["cpu_per_chunk_us"] = _r(client["cpu_per_chunk_us"], 0)
    if isinstance(client.get("processes"), int):
        evidence["client_processes"] = client["processes"]
    return [{
        "rule": RULE_CLIENT_SATURATED,
        "finding": ("a load-generating process is near a full core: the numbers measure the "
                    "client as much as the server"),
        "evidence": evidence,
        "look_at": "add client processes (--procs) or channels, or run the client elsewhere",
    }]


def _under_capacity(run: _Run, fired: set[str]) -> list[Finding]:
    itl, ttft, typical = run.itl, run.ttft, run.typical_step
    tokens_per_s = run.result.get("tokens_per_s")
    if not (itl and ttft and typical and run.workers and _finite(tokens_per_s)):
        return []
    latency_rules = {RULE_TTFT_ENGINE_START, RULE_TTFT_QUEUEING, RULE_ITL_UNSTABLE_ENGINE,
                     RULE_ITL_UNSTABLE_NETWORK, RULE_SLOW_READER, RULE_FRONT_CPU_BOUND,
                     RULE_CLIENT_SATURATED, RULE_STREAMS_STALL_TOGETHER,
                     RULE_TTFT_GROWS_WITH_STREAMS, RULE_FRONT_LOOP_BLOCKED,
                     RULE_SLOW_WORKER}
    if fired & latency_rules:
        return []
    if (itl["p50"] > SLOW_READER_ITL_FACTOR * typical
            or ttft["p50"] > max(TTFT_HIGH_STEPS * typical, TTFT_HIGH_MIN_MS)):
        return []
    per_step = tokens_per_s * typical / 1e3 / len(run.workers)
    if per_step >= UNDER_CAPACITY_BATCH:
        return []
    evidence = {
        "tokens_per_worker_step": _r(per_step),
        "tokens_per_s": _r(tokens_per_s, 0),
        "workers": len(run.workers),
        "engine_step_p50_ms": _r(typical),
        "itl_p50_ms": _r(itl["p50"]),
        "ttft_p50_ms": _r(ttft["p50"]),
    }
    concurrency = (run.result.get("workload") or {}).get("concurrency")
    if concurrency is not None:
        evidence["concurrency"] = concurrency
    return [{
        "rule": RULE_UNDER_CAPACITY,
        "finding": (f"latency is normal but each worker makes {per_step:.1f} tokens per engine "
                    "step: the server has room for more streams"),
        "evidence": evidence,
        "look_at": "raise the concurrency (or the request rate) until latency starts to grow",
    }]


def _cpu_busy_cards_idle(run: _Run) -> list[Finding]:
    system = run.result.get("system") or {}
    flags = system.get("flags") or []
    if not flags:
        return []
    gpus = {f"gpu{g.get('index', i)}_util_pct": _r(g["util_pct_mean"], 1)
            for i, g in enumerate(system.get("gpus") or []) if _finite(g.get("util_pct_mean"))}
    cpu = {f"{name}_cpu_pct_mean": _r(p["cpu_pct_mean"], 1)
           for name, p in (system.get("processes") or {}).items()
           if _finite(p.get("cpu_pct_mean"))}
    return [{
        "rule": RULE_CPU_BUSY_CARDS_IDLE,
        "finding": flag,
        "evidence": {**cpu, **gpus},
        "look_at": ("host-side work that keeps the cards waiting: data movement, collective "
                    "communication on CPU, Python between steps, the front"),
    } for flag in flags]


def _client_side(run: _Run) -> dict | None:
    """The timeline, for runs without server timing (with it, the segment rules speak)."""
    if run.result.get("segments_ms"):
        return None
    found = run.result.get("timeline")
    return found if isinstance(found, dict) else None


def _stalled_together(stalls: dict) -> bool:
    """Enough stalls of every open stream at once to explain the gap tail (SHARED_*)."""
    return (bool(stalls) and stalls["shared"] >= SHARED_STALLS_MIN
            and stalls["shared_time_share"] >= SHARED_TIME_SHARE and stalls["long_gaps"] > 0
            and stalls["long_gaps_in_shared"] / stalls["long_gaps"] >= SHARED_LONG_GAP_SHARE)


def _streams_stall_together(run: _Run) -> list[Finding]:
    timeline = _client_side(run)
    stalls = (timeline or {}).get("stalls") or {}
    if not _stalled_together(stalls):
        return []
    gaps = _dist(run.result, "chunk_gap_ms")
    evidence = {
        "shared_stalls": stalls["shared"],
        "stall_p50_ms": _r(stalls["shared_ms_p50"]),
        "stall_max_ms": _r(stalls["shared_ms_max"]),
        "run_share_stalled": _r(stalls["shared_time_share"], 3),
        "streams_hit_p50": _r(stalls["streams_hit_p50"], 1),
        "streams_hit_min": stalls["streams_hit_min"],
        "long_gaps_in_shared_stalls": f"{stalls['long_gaps_in_shared']} of {stalls['long_gaps']}",
        "gap_p50_ms": _r(timeline["gap_p50_ms"]),
    }
    if gaps:
        evidence["gap_p99_ms"] = _r(gaps["p99"])
    return [{
        "rule": RULE_STREAMS_STALL_TOGETHER,
        "finding": (f"every open stream stalled at the same instants: {stalls['shared']} times "
                    f"(up to {stalls['shared_ms_max']:.0f} ms, {stalls['shared_time_share']:.0%}"
                    f" of the run) no stream got anything although a median of "
                    f"{stalls['streams_hit_p50']:.0f} were open; the pause is on the server's "
                    "side, not any one stream's"),
        "evidence": evidence,
        "look_at": ("what can pause the whole server: a blocking call on its event loop, a "
                    "thread pool or one queue that every stream waits on, the GIL held by "
                    "compute, garbage collection, an engine (or its producer) blocked on a full "
                    "queue; run the server under a profiler (py-spy) during the stalls"),
    }]


def _ttft_grows_with_streams(run: _Run) -> list[Finding]:
    timeline = _client_side(run)
    gaps = _dist(run.result, "chunk_gap_ms")
    if not timeline or not gaps or gaps["p50"] <= 0:
        return []
    if gaps["p90"] > GAPS_NORMAL_RATIO * gaps["p50"]:
        return []  # everything is slow or uneven: not a start-up limit alone
    typical = timeline["gap_p50_ms"]
    high = max(TTFT_GROWTH_GAPS * typical, TTFT_GROWTH_MIN_MS)
    bursts, cap = timeline["bursts"], timeline["concurrency"]
    capped = (cap["peak_receiving"] <= CAP_RECEIVING_SHARE * cap["peak_open"]
              and cap["capped_share"] >= CAP_TIME_SHARE and run.ttft is not None
              and run.ttft["p90"] >= high)
    spread = bursts["ttft_p90_ms"] - bursts["ttft_p10_ms"]
    burst = bursts["largest"] >= MIN_BURST and _finite(spread) and spread >= high
    if not (capped or burst):
        return []
    evidence = {
        "largest_burst": bursts["largest"],
        "burst_ttft_p10_ms": _r(bursts["ttft_p10_ms"]),
        "burst_ttft_p90_ms": _r(bursts["ttft_p90_ms"]),
        "peak_open_streams": cap["peak_open"],
        "peak_receiving_streams": cap["peak_receiving"],
        "share_at_cap_with_streams_waiting": _r(cap["capped_share"], 3),
        "gap_p50_ms": _r(gaps["p50"]),
        "gap_p90_ms": _r(gaps["p90"]),
    }
    if bursts["opened_alone"]:
        evidence["ttft_p50_opened_alone_ms"] = _r(bursts["alone_ttft_p50_ms"])
    if capped:
        finding = (f"at most {cap['peak_receiving']} streams received output at once while up "
                   f"to {cap['peak_open']} were open: the others waited for their first output "
                   f"(TTFT p90 {run.ttft['p90']:.0f} ms) although gaps stay normal (p50 "
                   f"{gaps['p50']:.1f} ms); something holds one slot per stream")
        look_at = ("a thread per stream (a ThreadPoolExecutor's max_workers, a sync handler "
                   "that holds its thread while it waits for output), the server's max "
                   "concurrent streams, an engine batch limit; forward output without holding a "
                   "thread (an async server, per-request queues)")
    else:
        finding = (f"of {bursts['largest']} streams opened at once, the first tenth got output "
                   f"within {bursts['ttft_p10_ms']:.0f} ms and the last tenth after "
                   f"{bursts['ttft_p90_ms']:.0f} ms, while gaps stay normal (p50 "
                   f"{gaps['p50']:.1f} ms): new streams are taken in one at a time")
        look_at = ("call set-up: a server that accepts calls one at a time, a lock or a slow "
                   "step at the start of each call (authentication, a per-call model lookup), "
                   "an engine that admits one request per step, too few threads for new calls")
    return [{
        "rule": RULE_TTFT_GROWS_WITH_STREAMS,
        "finding": finding,
        "evidence": evidence,
        "look_at": look_at,
    }]


def _loop_lag(result: dict) -> dict | None:
    """The front's loop lag over the run: from the timed streams' tallies, else from the
    scraped metrics (`--metrics-port`), as {samples, late_over_20ms, ...}; None without."""
    found = result.get("front_loop")
    if isinstance(found, dict) and found.get("samples"):
        return found
    scraped = ((result.get("system") or {}).get("server_metrics") or {}).get("front_loop")
    if isinstance(scraped, dict) and scraped.get("samples"):
        return scraped
    return None


def _front_loop_blocked(run: _Run) -> list[Finding]:
    gaps = _dist(run.result, "chunk_gap_ms")
    if not gaps:
        return []
    lag = _loop_lag(run.result)
    late = lag["late_over_20ms"] if lag else 0
    direct = (lag is not None and late >= LOOP_LATE_MIN
              and late / lag["samples"] >= LOOP_LATE_SHARE
              and gaps["p99"] - gaps["p50"] >= LOOP_GAP_TAIL_MS)
    stalls = ((run.result.get("timeline") or {}).get("stalls") or {})
    step = run.step
    together = (_stalled_together(stalls) and step is not None and run.typical_step is not None
                and not (step["p90"] >= ENGINE_UNSTABLE_P90_RATIO * step["p50"]
                         and step["p90"] - step["p50"] >= ENGINE_UNSTABLE_MIN_MS))
    if not (direct or together):
        return []
    evidence: dict = {"gap_p50_ms": _r(gaps["p50"]), "gap_p99_ms": _r(gaps["p99"])}
    if lag is not None:
        evidence["loop_wakeups_late_over_20ms"] = f"{late:.0f} of {lag['samples']:.0f}"
        for key in ("p99_ms_at_most", "max_ms_at_most"):
            if key in lag:
                evidence[f"loop_lag_{key}"] = lag[key]
    if stalls and stalls["shared"]:
        evidence["stalls_of_every_stream"] = stalls["shared"]
        evidence["streams_hit_per_stall_p50"] = _r(stalls["streams_hit_p50"], 1)
    if step is not None:
        evidence["engine_step_p50_ms"] = _r(step["p50"])
        evidence["engine_step_p90_ms"] = _r(step["p90"])
    if direct:
        finding = (f"the front's event loop was blocked: {late:.0f} of its "
                   f"{lag['samples']:.0f} timer wake-ups came more than 20 ms late, and the "
                   f"streams' gaps have a tail of the same size (p99 {gaps['p99']:.0f} ms "
                   f"against p50 {gaps['p50']:.0f} ms)")
    else:
        finding = (f"every open stream stalled at the same instants ({stalls['shared']} "
                   f"times, a median of {stalls['streams_hit_p50']:.0f} streams each) while "
                   "the engine's steps did not: the front stopped sending")
    return [{
        "rule": RULE_FRONT_LOOP_BLOCKED,
        "finding": finding,
        "evidence": evidence,
        "look_at": ("blocking calls in async code on the front (time.sleep, file or network "
                    "I/O, a lock, heavy Python between awaits), user code running in the front "
                    "(--app-in-front: move it to workers or make it await), garbage "
                    "collection pauses, a front at a full core (front_cpu_bound); py-spy dump "
                    "of the front during a stall shows the culprit"),
    }]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _slow_worker(run: _Run) -> list[Finding]:
    workers = [w for w in run.result.get("workers") or []
               if _finite(w.get("step_ms_p50")) and _finite(w.get("itl_ms_p50"))
               and w.get("steps", 0) >= MIN_CPU_SAMPLES]
    if len(workers) < 2:
        return []
    findings = []
    for w in workers:
        others = [o for o in workers if o is not w]
        step = _median([o["step_ms_p50"] for o in others])
        batch = _median([o["sequences_per_step_p50"] for o in others])
        itl = _median([o["itl_ms_p50"] for o in others])
        if not (w["step_ms_p50"] >= SLOW_WORKER_RATIO * step
                and w["step_ms_p50"] - step >= SLOW_WORKER_MIN_MS
                and batch / SLOW_WORKER_BATCH_RATIO <= w["sequences_per_step_p50"]
                <= batch * SLOW_WORKER_BATCH_RATIO
                and w["itl_ms_p50"] >= SLOW_WORKER_ITL_RATIO * itl):
            continue
        name = f"worker {w['worker']}" + (f" ({w['device']})" if w.get("device") else "")
        evidence = {
            "worker": w["worker"],
            "device": w.get("device"),
            "step_p50_ms": _r(w["step_ms_p50"]),
            "others_step_p50_ms": _r(step),
            "sequences_per_step": _r(w["sequences_per_step_p50"], 1),
            "others_sequences_per_step": _r(batch, 1),
            "its_streams_itl_p50_ms": _r(w["itl_ms_p50"]),
            "other_streams_itl_p50_ms": _r(itl),
            "token_share": _r(w["token_share"], 3),
        }
        cpu = _active_cpu(run.result, f"worker{w['worker']}")
        if cpu is not None:
            evidence[f"worker{w['worker']}_cpu_pct"] = _r(cpu, 1)
        findings.append({
            "rule": RULE_SLOW_WORKER,
            "finding": (f"{name} steps in {w['step_ms_p50']:.1f} ms at p50 against "
                        f"{step:.1f} ms for the others at a comparable batch, and the streams "
                        f"it serves get a token every {w['itl_ms_p50']:.1f} ms against "
                        f"{itl:.1f} ms: one card is slow, not the engine as a whole"),
            "evidence": evidence,
            "look_at": (f"that card: its clocks and temperature, other jobs on it, its PCIe / "
                        f"NVLink, the host CPU of its process (worker{w['worker']}); then the "
                        "router, which gives it as many streams as the others"),
        })
    return findings


_RULES: tuple[Callable[[_Run], list[Finding]], ...] = (
    _ttft_engine_start,
    _ttft_queueing,
    _itl_unstable,
    _slow_reader,
    _front_cpu_bound,
    _client_saturated,
    _cpu_busy_cards_idle,
    _streams_stall_together,
    _ttft_grows_with_streams,
    _front_loop_blocked,
    _slow_worker,
)


def diagnose(result: dict) -> list[Finding]:
    """The findings for a `run_bench` result, in rule order; empty when no rule fired."""
    run = _Run(result)
    findings = [f for rule in _RULES for f in rule(run)]
    if any(f["rule"] == RULE_FRONT_LOOP_BLOCKED for f in findings):
        findings = [f for f in findings if not _explained_by_blocked_loop(f, run)]
    if any(f["rule"] == RULE_SLOW_WORKER for f in findings) and _each_worker_steady(run):
        # The steps vary between workers, not within one: the slow card is the finding.
        findings = [f for f in findings if f["rule"] != RULE_ITL_UNSTABLE_ENGINE]
    findings += _under_capacity(run, {f["rule"] for f in findings})
    return findings


def _each_worker_steady(run: _Run) -> bool:
    return all(w["step_ms_p90"] < ENGINE_UNSTABLE_P90_RATIO * w["step_ms_p50"]
               or w["step_ms_p90"] - w["step_ms_p50"] < ENGINE_UNSTABLE_MIN_MS
               for w in run.result.get("workers") or [] if _finite(w.get("step_ms_p90")))


def _explained_by_blocked_loop(finding: Finding, run: _Run) -> bool:
    """Findings a blocked front loop explains: the engine's steps "jittering" or a slow
    admitting step when the engine runs in the front (no worker processes: its steps wait
    for the loop too), and TTFT put on admission into the front (the loop could not take the
    calls in)."""
    if finding["rule"] in (RULE_ITL_UNSTABLE_ENGINE, RULE_TTFT_ENGINE_START):
        return not run.workers
    if finding["rule"] == RULE_TTFT_QUEUEING:
        return "client_to_front" in finding["finding"]
    return False

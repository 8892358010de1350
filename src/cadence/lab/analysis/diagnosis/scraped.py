"""Rules on the server's own metrics read with `cadence bench --scrape` (any server whose
names `cadence.lab.measure.prometheus` knows: vLLM, SGLang, Triton, TensorRT-LLM):
`server_queue_grows` (requests wait while the running batch sits at its largest: a limit on
requests running at once) and `kv_cache_full` (requests wait while the KV cache is full)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import RULE_KV_CACHE_FULL, RULE_SERVER_QUEUE_GROWS
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.results import Finding, ScrapedRole

MIN_SCRAPES = 3
"""Scrapes inside the run needed before a role says anything (one every
prometheus.SCRAPE_INTERVAL_S)."""

WAITING_MIN = 1.0
"""A scrape "has a queue" from this many requests waiting."""

QUEUED_SHARE = 0.25
"""The queue counts when it was there in at least this share of the run's scrapes: a
request or two waiting for the next step now and then is how a busy server admits work."""

RUNNING_AT_MAX = 0.9
"""Running is "at its largest" within this share of its peak in the run (a batch limit of
64 shows as 58-64 running: requests finish and are replaced between steps)."""

AT_MAX_SHARE = 0.7
"""...in at least this share of the scrapes with a queue: requests waited because the batch
was full, not while it was still filling."""

KV_FULL = 0.9
"""The KV cache is full from this share in use: vLLM and SGLang keep a few blocks free for
the running requests' next tokens, so a cache that admits nothing more reads 0.9-0.99."""

KV_FULL_SHARE = 0.1
"""...with requests waiting (or being preempted) in at least this share of the run's
scrapes, and MIN_SCRAPES of them at least."""

GROWS_FACTOR = 1.5
"""The queue "grows" when its mean over the last third of the run is this many times its
mean over the first third (else it "holds")."""


def _inside(facts: RunFacts, role: str) -> tuple[ScrapedRole | None, dict[float, float]]:
    """A role of the scraped metrics and its points inside the run's window, by time."""
    scraped = facts.result.scraped or None
    found = scraped.roles.get(role) if scraped is not None else None
    if scraped is None or found is None:
        return None, {}
    window = scraped.run_window_s
    return found, {t: v for t, v in found.points if window is None or window[0] <= t <= window[1]}


def _metrics(*roles: ScrapedRole | None) -> str:
    return ", ".join(r.metric for r in roles if r is not None)


def server_queue_grows(facts: RunFacts) -> list[Finding]:
    waiting_role, waiting = _inside(facts, "waiting")
    running_role, running = _inside(facts, "running")
    both = sorted(set(waiting) & set(running))
    if len(both) < MIN_SCRAPES:
        return []
    queued = [t for t in both if waiting[t] >= WAITING_MIN]
    top = max(running[t] for t in both)
    if top < 1 or len(queued) < MIN_SCRAPES or len(queued) < QUEUED_SHARE * len(both):
        return []
    at_max = [t for t in queued if running[t] >= RUNNING_AT_MAX * top]
    if len(at_max) < AT_MAX_SHARE * len(queued):
        return []
    third = max(1, len(both) // 3)
    first = sum(waiting[t] for t in both[:third]) / third
    last = sum(waiting[t] for t in both[-third:]) / third
    grows = last >= GROWS_FACTOR * max(first, WAITING_MIN)
    peak = max(waiting[t] for t in queued)
    mean = sum(waiting[t] for t in queued) / len(queued)
    evidence: dict = {
        "waiting_peak": rounded(peak, 1),
        "waiting_mean_while_queued": rounded(mean, 1),
        "scrapes_with_a_queue": f"{len(queued)} of {len(both)}",
        "running_max": rounded(top, 1),
        "queued_scrapes_running_at_max": f"{len(at_max)} of {len(queued)}",
        "waiting_first_third_mean": rounded(first, 1),
        "waiting_last_third_mean": rounded(last, 1),
        "metrics": _metrics(running_role, waiting_role),
    }
    if facts.ttft:
        evidence["ttft_p50_ms"] = rounded(facts.ttft.p50)
    how = f"grew from {first:.0f} to {last:.0f}" if grows else f"held {mean:.0f} on average"
    return [
        Finding(
            rule=RULE_SERVER_QUEUE_GROWS,
            finding=(
                f"the server's own queue {how} (up to {peak:.0f} requests waiting, in "
                f"{len(queued)} of the run's {len(both)} scrapes) while the requests it "
                f"ran stayed at their largest, {top:.0f}: new requests wait for a place in "
                "the batch, and TTFT includes the wait"
            ),
            evidence=evidence,
            look_at=(
                "the server's limit on requests running at once: vLLM --max-num-seqs (and "
                "--max-num-batched-tokens), SGLang --max-running-requests, TensorRT-LLM "
                "max_batch_size, Triton's dynamic batcher and instance count, cadence "
                "--max-batch; or more replicas, or a lower concurrency or rate"
            ),
        )
    ]


def kv_cache_full(facts: RunFacts) -> list[Finding]:
    kv_role, kv = _inside(facts, "kv_cache_use")
    waiting_role, waiting = _inside(facts, "waiting")
    preempted_role, preempted = _inside(facts, "preempted")
    if len(kv) < MIN_SCRAPES:
        return []
    full = [t for t in sorted(kv) if kv[t] >= KV_FULL]
    pressed = [t for t in full if waiting.get(t, 0.0) >= WAITING_MIN or preempted.get(t, 0.0) > 0]
    if len(pressed) < MIN_SCRAPES or len(pressed) < KV_FULL_SHARE * len(kv):
        return []
    peak = max(kv.values())
    evidence: dict = {
        "kv_cache_use_peak": rounded(peak, 3),
        "scrapes_full_with_requests_waiting": f"{len(pressed)} of {len(kv)}",
        "metrics": _metrics(kv_role, waiting_role, preempted_role),
    }
    queue = [waiting[t] for t in pressed if t in waiting]
    if queue:
        evidence["waiting_peak"] = rounded(max(queue), 1)
    preemptions = [preempted[t] for t in pressed if t in preempted]
    if preemptions:
        evidence["preempted_per_s_peak"] = rounded(max(preemptions), 2)
    also = (
        f", and the server preempted up to {max(preemptions):.1f} requests/s to make room"
        if preemptions and max(preemptions) > 0
        else ""
    )
    return [
        Finding(
            rule=RULE_KV_CACHE_FULL,
            finding=(
                f"the server's KV cache was {peak:.0%} in use with requests waiting in "
                f"{len(pressed)} of the run's {len(kv)} scrapes{also}: it admits a request "
                "only when running ones free their cache, so the cache, not the batch "
                "limit, sets how many run at once"
            ),
            evidence=evidence,
            look_at=(
                "the KV cache's size against the requests' lengths: vLLM "
                "--gpu-memory-utilization, --max-model-len, --kv-cache-dtype fp8; SGLang "
                "--mem-fraction-static; shorter prompts or outputs (--max-tokens), a lower "
                "concurrency, or more cards (tensor parallel) or replicas"
            ),
        )
    ]


RULES = (
    Rule(RULE_KV_CACHE_FULL, kv_cache_full),
    # A full cache caps the batch below the server's limit on running requests: the cache is
    # the cause to name, not a batch limit.
    Rule(RULE_SERVER_QUEUE_GROWS, server_queue_grows, gives_way_to=(GiveWay(RULE_KV_CACHE_FULL),)),
)

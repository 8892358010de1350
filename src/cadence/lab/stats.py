"""Aggregates computed after a run from the raw records. Field names carry their units.

Definitions (all from client-side monotonic timestamps unless marked "server"):
- ttft_ms: first chunk's arrival − the request's send time.
- itl_ms: for every chunk after the first, (its arrival − the previous chunk's arrival)
  ÷ the tokens in it. A merged chunk of k tokens contributes one value, the gap over k.
- chunk_gap_ms: the raw gap between consecutive chunks of a stream.
- tpot_ms: per request, (end-to-end − ttft) ÷ (output tokens − 1).
- e2e_ms: last chunk's arrival − send time.
- token_delay_ms: a chunk's arrival − the end of the engine step that made its first
  (oldest) token (server step end, client arrival: same host, same monotonic clock).
- segments (server timing): queue = worker scheduled − front received; engine = step end −
  step start; transfer = front read − step end; buffer = handed to gRPC − front read;
  send = client arrival − handed to gRPC.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import msgspec

from cadence.lab.records import RequestRecord

_NS_PER_MS = 1e6


class Distribution(msgspec.Struct, kw_only=True):
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    min: float


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolating linearly between ranks."""
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(values: Iterable[float]) -> Distribution:
    ordered = sorted(values)
    if not ordered:
        nan = math.nan
        return Distribution(count=0, mean=nan, p50=nan, p90=nan, p99=nan, max=nan, min=nan)
    return Distribution(
        count=len(ordered),
        mean=sum(ordered) / len(ordered),
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p99=percentile(ordered, 99),
        max=ordered[-1],
        min=ordered[0],
    )


class Integrity(msgspec.Struct, kw_only=True):
    """Tokens lost, repeated or out of order, from every chunk's `index`; all must be 0."""

    lost_tokens: int = 0
    repeated_tokens: int = 0
    reordered_chunks: int = 0
    short_streams: int = 0
    """Streams that ended OK without a final chunk, or with fewer than max_tokens tokens
    after a LENGTH finish."""


def check_integrity(records: list[RequestRecord]) -> Integrity:
    result = Integrity()
    for r in records:
        expected = 0
        for index, count in zip(r.index, r.tokens):
            if index > expected:
                result.lost_tokens += index - expected
            elif index < expected:
                result.repeated_tokens += min(expected - index, count)
                result.reordered_chunks += 1
            expected = max(expected, index + count)
        if r.code != "OK":
            continue
        if r.finish_reason == 0:
            result.short_streams += 1
        elif r.finish_reason == 1 and expected != r.max_tokens:
            result.short_streams += 1
            result.lost_tokens += max(0, r.max_tokens - expected)
    return result


def summarize(records: list[RequestRecord]) -> dict:
    """Every aggregate of a run, as plain data for JSON and the report."""
    ok = [r for r in records if r.code == "OK" and r.arrival_ns]
    ttft, itl, gaps, tpot, e2e, chunk_tokens = [], [], [], [], [], []
    delay, engine, transfer, buffer, send, queue, to_front = [], [], [], [], [], [], []
    for r in ok:
        arrival, tokens = r.arrival_ns, r.tokens
        ttft.append((arrival[0] - r.start_ns) / _NS_PER_MS)
        e2e.append((arrival[-1] - r.start_ns) / _NS_PER_MS)
        chunk_tokens.extend(tokens)
        for i in range(1, len(arrival)):
            gap = (arrival[i] - arrival[i - 1]) / _NS_PER_MS
            gaps.append(gap)
            if tokens[i]:
                itl.append(gap / tokens[i])
        total = sum(tokens)
        if total > 1:
            tpot.append((e2e[-1] - ttft[-1]) / (total - 1))
        if r.t_send_ns:
            if r.t_received_ns:
                to_front.append((r.t_received_ns - r.start_ns) / _NS_PER_MS)
                queue.append((r.t_scheduled_ns - r.t_received_ns) / _NS_PER_MS)
            for a, s0, s1, fr, sd in zip(
                arrival, r.t_step_start_ns, r.t_step_end_ns, r.t_front_recv_ns, r.t_send_ns
            ):
                if not s1:  # a final chunk with no tokens carries no step times
                    continue
                delay.append((a - s1) / _NS_PER_MS)
                engine.append((s1 - s0) / _NS_PER_MS)
                transfer.append((fr - s1) / _NS_PER_MS)
                buffer.append((sd - fr) / _NS_PER_MS)
                send.append((a - sd) / _NS_PER_MS)
    starts = [r.start_ns for r in records]
    ends = [r.end_ns for r in records]
    wall_s = (max(ends) - min(starts)) / 1e9 if records else math.nan
    out_tokens = sum(sum(r.tokens) for r in ok)
    result = {
        "requests": len(records),
        "requests_ok": len(ok),
        "errors_by_code": dict(Counter(r.code for r in records if r.code != "OK")),
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "chunks": len(chunk_tokens),
        "requests_per_s": len(ok) / wall_s if wall_s else math.nan,
        "tokens_per_s": out_tokens / wall_s if wall_s else math.nan,
        "chunks_per_s": len(chunk_tokens) / wall_s if wall_s else math.nan,
        "ttft_ms": distribution(ttft),
        "itl_ms": distribution(itl),
        "chunk_gap_ms": distribution(gaps),
        "tpot_ms": distribution(tpot),
        "e2e_ms": distribution(e2e),
        "chunk_tokens": distribution(chunk_tokens),
        "integrity": check_integrity(records),
    }
    if delay:
        result["token_delay_ms"] = distribution(delay)
        result["segments_ms"] = {
            "client_to_front": distribution(to_front),
            "queue": distribution(queue),
            "engine_step": distribution(engine),
            "transfer": distribution(transfer),
            "buffer": distribution(buffer),
            "send": distribution(send),
        }
    return msgspec.to_builtins(result)

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
- segments_ms (server timing, per chunk's first token): engine_step = step end − step
  start; transfer = front read − step end; buffer = handed to gRPC − front read; send =
  client arrival − handed to gRPC. Per request: client_to_front = front received − sent;
  queue = the admitting step's start − front received.
- ttft_segments_ms: the first chunk's client_to_front, queue, first_step, transfer, buffer
  and send; they add up to ttft_ms exactly.
- segment_shares: each segment's mean over the sum of the means, for TTFT and for a
  token's path from step start to client (engine_step, transfer, buffer, send).
- handoff_segments_ms (disaggregated serving, server timing, per handed-off request): export
  = the front read the state − the first token's step end (on the prefill worker);
  to_decode = the start of the decode worker's first step with it − the front read the
  state; with the requests per prefill and per decode worker.
- timeline: the streams' arrival times read together (shared stalls, bursts of streams
  opened at once, open against receiving streams); defined in `cadence.lab.timeline`.
- connect_ms (HTTP): per request that opened a new connection, the time to make it (TCP
  connect, TLS handshake), from the client's connection trace; a part of its TTFT.
- ttft_after_connect_ms (HTTP): per request, ttft_ms less its connect time (0 on a connection
  already open): what the server and the path after the connection took.
- ttft_from_schedule_ms, e2e_from_schedule_ms (open loop: a rate or a trace): the same, counted
  from the time the schedule meant the request to go rather than when it went; apart from
  ttft_ms by the dispatch delay (`client.schedule_lag_ms`). A client that sends late hides
  the server's delay from ttft_ms (coordinated omission); not from these.
- ttft_reasoning_ms, ttft_answer_ms (OpenAI, a server that streams reasoning apart from the
  answer): the first reasoning output's and the first answer output's arrival − send time,
  over the requests with reasoning; ttft_ms is the first output of either.
- ttft_by_turn_ms (conversations, traces with sessions): ttft_ms of each turn by its number.
- cached_tokens: the prompt tokens the server said it had cached, over the requests it said
  it for, and their share of the prompt tokens sent.
- cancelled_by_client: requests the client cancelled on purpose (`--cancel-ms`), left out of
  errors_by_code (not the server's failures); by_population: each client population's
  requests, status codes, TTFT (cancelled requests with a first chunk included), ITL and
  e2e (requests that ended OK); by_class: the same of each request class (`--mix`), with
  its prompt and max_tokens lengths.
- every distribution's p999: the 99.9th percentile, interpolated between ranks.
- front_loop (server timing from cadence): how late the front's event loop woke for its
  heartbeat timer during the run, from the lag tallies timed streams carry (the tally at the
  first stream's start against the one at the last stream's end, per front, added up):
  samples, those over 20 ms, and the p99 and max as the upper bounds of their buckets.
"""

from __future__ import annotations

import math
from collections import Counter

from cadence.lab.analysis.integrity import check_integrity
from cadence.lab.analysis.timeline import timeline
from cadence.lab.percentile import distribution
from cadence.lab.records import CLIENT_CANCELLED, RequestRecord
from cadence.lab.results import (
    CachedTokens,
    FrontLoop,
    HandOffSegments,
    Population,
    RunStats,
    Segments,
    SegmentShares,
    TtftSegments,
)
from cadence.proto import loop_lag

_NS_PER_MS = 1e6

TTFT_SEGMENTS = TtftSegments.__struct_fields__
"""Time to first token, split where it is spent; the segments add up to TTFT exactly."""


def is_ok(r: RequestRecord) -> bool:
    """A request that finished with status OK and received at least one chunk."""
    return r.code == "OK" and bool(r.arrival_ns)


def ttft_ms(r: RequestRecord) -> float:
    """The request's time to first token (ms); `r` must have a chunk."""
    return (r.arrival_ns[0] - r.start_ns) / _NS_PER_MS


def itl_points(r: RequestRecord) -> list[tuple[int, float]]:
    """(arrival_ns, itl_ms) for every chunk after the first that carries tokens."""
    arrival, tokens = r.arrival_ns, r.tokens
    return [
        (arrival[i], (arrival[i] - arrival[i - 1]) / _NS_PER_MS / tokens[i])
        for i in range(1, len(arrival))
        if tokens[i]
    ]


def summarize(records: list[RequestRecord]) -> RunStats:
    """Every aggregate of a run."""
    ok = [r for r in records if is_ok(r)]
    itl: list[float] = []
    ttft, gaps, tpot, e2e, chunk_tokens = [], [], [], [], []
    delay, engine, transfer, buffer, send, queue, to_front = [], [], [], [], [], [], []
    first: dict[str, list[float]] = {name: [] for name in TTFT_SEGMENTS}
    connect, after_connect = [], []
    for r in ok:
        arrival, tokens = r.arrival_ns, r.tokens
        ttft.append(ttft_ms(r))
        if r.connect_ns >= 0:
            if r.connect_ns:
                connect.append(r.connect_ns / _NS_PER_MS)
            after_connect.append(ttft[-1] - r.connect_ns / _NS_PER_MS)
        e2e.append((arrival[-1] - r.start_ns) / _NS_PER_MS)
        chunk_tokens.extend(tokens)
        for i in range(1, len(arrival)):
            gaps.append((arrival[i] - arrival[i - 1]) / _NS_PER_MS)
        itl.extend(value for _, value in itl_points(r))
        total = sum(tokens)
        if total > 1:
            tpot.append((e2e[-1] - ttft[-1]) / (total - 1))
        if r.t_send_ns:
            if r.t_received_ns and r.t_step_end_ns[0]:
                to_front.append((r.t_received_ns - r.start_ns) / _NS_PER_MS)
                queue.append((r.t_scheduled_ns - r.t_received_ns) / _NS_PER_MS)
                first["client_to_front"].append(to_front[-1])
                first["queue"].append(queue[-1])
                first["first_step"].append((r.t_step_end_ns[0] - r.t_step_start_ns[0]) / _NS_PER_MS)
                first["transfer"].append((r.t_front_recv_ns[0] - r.t_step_end_ns[0]) / _NS_PER_MS)
                first["buffer"].append((r.t_send_ns[0] - r.t_front_recv_ns[0]) / _NS_PER_MS)
                first["send"].append((arrival[0] - r.t_send_ns[0]) / _NS_PER_MS)
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
    out_tokens = sum(r.output_tokens for r in ok)
    result = RunStats(
        requests=len(records),
        requests_ok=len(ok),
        errors_by_code=dict(
            Counter(r.code for r in records if r.code not in ("OK", CLIENT_CANCELLED))
        ),
        first_error_by_code=_first_errors(records),
        wall_s=wall_s,
        output_tokens=out_tokens,
        chunks=len(chunk_tokens),
        requests_per_s=len(ok) / wall_s if wall_s else math.nan,
        tokens_per_s=out_tokens / wall_s if wall_s else math.nan,
        chunks_per_s=len(chunk_tokens) / wall_s if wall_s else math.nan,
        ttft_ms=distribution(ttft),
        itl_ms=distribution(itl),
        chunk_gap_ms=distribution(gaps),
        tpot_ms=distribution(tpot),
        e2e_ms=distribution(e2e),
        chunk_tokens=distribution(chunk_tokens),
        integrity=check_integrity(records),
        timeline=timeline(records),
        front_loop=front_loop(records),
    )
    if after_connect:
        result.connect_ms = distribution(connect)
        result.ttft_after_connect_ms = distribution(after_connect)
    scheduled = [r for r in ok if r.scheduled_ns]
    if scheduled:
        result.ttft_from_schedule_ms = distribution(
            (r.arrival_ns[0] - r.scheduled_ns) / _NS_PER_MS for r in scheduled
        )
        result.e2e_from_schedule_ms = distribution(
            (r.arrival_ns[-1] - r.scheduled_ns) / _NS_PER_MS for r in scheduled
        )
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.turn:
            by_turn.setdefault(r.turn, []).append(ttft_ms(r))
    if by_turn:
        result.ttft_by_turn_ms = {str(t): distribution(v) for t, v in sorted(by_turn.items())}
    cancelled = sum(1 for r in records if r.code == CLIENT_CANCELLED)
    if cancelled:
        result.cancelled_by_client = cancelled
    if any(r.population for r in records):
        result.by_population = {name: population(group) for name, group in grouped(records).items()}
    if any(r.request_class for r in records):
        result.by_class = {
            name: population(group, lengths=True)
            for name, group in grouped(records, "request_class").items()
        }
    reasoned = [r for r in ok if r.first_reasoning_ns]
    if reasoned:
        result.ttft_reasoning_ms = distribution(
            (r.first_reasoning_ns - r.start_ns) / _NS_PER_MS for r in reasoned
        )
        result.ttft_answer_ms = distribution(
            (r.first_answer_ns - r.start_ns) / _NS_PER_MS for r in reasoned if r.first_answer_ns
        )
    reported = [r for r in records if r.cached_tokens >= 0]
    if reported:
        sent = sum(r.prompt_tokens for r in reported)
        result.cached_tokens = CachedTokens(
            requests=len(reported),
            per_request=distribution(r.cached_tokens for r in reported),
            share_of_prompt=sum(r.cached_tokens for r in reported) / sent if sent else math.nan,
        )
    handed = [r for r in ok if r.prefill_worker >= 0 and r.t_send_ns and r.t_step_end_ns[0]]
    if handed:
        result.handoff_segments_ms = _handoff_segments(handed)
    if delay:
        result.token_delay_ms = distribution(delay)
        result.segments_ms = Segments(
            client_to_front=distribution(to_front),
            queue=distribution(queue),
            engine_step=distribution(engine),
            transfer=distribution(transfer),
            buffer=distribution(buffer),
            send=distribution(send),
        )
        token = {"engine_step": engine, "transfer": transfer, "buffer": buffer, "send": send}
        result.ttft_segments_ms = TtftSegments(
            **{name: distribution(v) for name, v in first.items()}
        )
        result.segment_shares = SegmentShares(ttft=_shares(first), token=_shares(token))
    return result


def _handoff_segments(handed: list[RequestRecord]) -> HandOffSegments:
    """The hand-off's parts of each request a prefill worker handed to a decode worker."""
    export, to_decode = [], []
    for r in handed:
        export.append((r.t_handoff_ns - r.t_step_end_ns[0]) / _NS_PER_MS)
        # The decode worker's first step: the first chunk whose step began after the state
        # reached the front (a stream of one token after the first has none).
        start = next((s for s in r.t_step_start_ns[1:] if s > r.t_handoff_ns), 0)
        if start:
            to_decode.append((start - r.t_handoff_ns) / _NS_PER_MS)
    return HandOffSegments(
        requests=len(handed),
        export=distribution(export),
        to_decode=distribution(to_decode),
        by_prefill_worker=dict(Counter(str(r.prefill_worker) for r in handed)),
        by_decode_worker=dict(Counter(str(r.worker) for r in handed)),
    )


def grouped(
    records: list[RequestRecord], key: str = "population"
) -> dict[str, list[RequestRecord]]:
    """The records by client population (or, by `key`, request class), in name order."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(getattr(r, key) or "plain", []).append(r)
    return dict(sorted(groups.items()))


def population(group: list[RequestRecord], lengths: bool = False) -> Population:
    """One group's requests and figures; with `lengths`, its prompt and max_tokens too."""
    ok = [r for r in group if is_ok(r)]
    out = Population(
        requests=len(group),
        requests_ok=len(ok),
        codes=dict(Counter(r.code for r in group)),
        ttft_ms=distribution(ttft_ms(r) for r in group if r.arrival_ns),
        itl_ms=distribution(v for r in ok for _, v in itl_points(r)),
        e2e_ms=distribution((r.arrival_ns[-1] - r.start_ns) / _NS_PER_MS for r in ok),
    )
    if lengths:
        out.prompt_tokens = distribution(r.prompt_tokens for r in group)
        out.max_tokens = distribution(r.max_tokens for r in group)
    return out


def _shares(segments: dict[str, list[float]]) -> dict[str, float]:
    """Each segment's mean as a fraction of the sum of the means (segments add up exactly)."""
    means = {name: sum(v) / len(v) if v else 0.0 for name, v in segments.items()}
    total = sum(means.values())
    return {name: m / total if total else math.nan for name, m in means.items()}


def _first_errors(records: list[RequestRecord]) -> dict[str, str]:
    """Each error code's first message, so a summary can say what went wrong."""
    first: dict[str, str] = {}
    for r in records:
        if r.code != "OK" and r.code not in first:
            first[r.code] = r.error[:300]
    return first


LATE_LOOP_S = 0.02
"""A wake-up of the front's loop this late or later counts as late (as the sampler's)."""


def front_loop(records: list[RequestRecord]) -> FrontLoop | None:
    """The front's loop lag over the run (see the module docstring); None without tallies."""
    first: dict[int, tuple[int, str]] = {}
    """Per front: the earliest stream start and the tally sent then."""
    last: dict[int, tuple[int, str]] = {}
    """Per front: the latest stream end and the tally sent then."""
    for r in records:
        if len(r.loop_lag) != 2:
            continue
        start, end = r.loop_lag
        front = loop_lag.front(end)
        if start and (front not in first or r.start_ns < first[front][0]):
            first[front] = (r.start_ns, start)
        if front not in last or r.end_ns >= last[front][0]:
            last[front] = (r.end_ns, end)
    if not first:
        return None
    bounds = loop_lag.BOUNDS_S
    delta = [0] * (len(bounds) + 1)
    for k, (_, start) in first.items():
        for i, (a, b) in enumerate(
            zip(loop_lag.counts(start), loop_lag.counts(last[k][1]), strict=True)
        ):
            delta[i] += b - a
    samples = sum(delta)
    edges = [*bounds, math.inf]
    late = sum(c for bound, c in zip(edges, delta, strict=True) if bound > LATE_LOOP_S)

    def upper(q: float) -> float:
        seen = 0
        for bound, count in zip(edges, delta, strict=True):
            seen += count
            if samples and seen >= q * samples:
                return bound * 1e3
        return math.nan

    return FrontLoop(
        fronts=len(first),
        samples=samples,
        late_over_20ms=late,
        late_share=late / samples if samples else 0.0,
        p99_ms_at_most=upper(0.99),
        max_ms_at_most=upper(1.0),
    )

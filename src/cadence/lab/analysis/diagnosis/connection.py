"""Rules on the client's connections to the server: `server_stream_limit` (the server's
HTTP/2 concurrent-stream limit is below the streams the client opens on one connection, so
the rest wait for a free stream or are refused) and `slow_connect` (over HTTP, making the
connections took much of the time to first token)."""

from __future__ import annotations

import math

from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import RULE_SERVER_STREAM_LIMIT, RULE_SLOW_CONNECT
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.results import Finding
from cadence.wording import counted

REFUSED_TEXTS = ("REFUSED_STREAM", "error code 7")
"""How gRPC clients word a stream the server refused (HTTP/2 error code 7, REFUSED_STREAM)
in a call's error message."""


def refused_calls(facts: RunFacts) -> int:
    """Calls that ended with the server refusing their stream, by the run's error messages
    (each code's first message stands for that code's count)."""
    result = facts.result
    return sum(
        result.errors_by_code.get(code, 0)
        for code, message in result.first_error_by_code.items()
        if any(text in message for text in REFUSED_TEXTS)
    )


def streams_per_connection(facts: RunFacts) -> int | None:
    """The most streams the run opened on one connection: the closed loop's streams, or the
    open loop's peak of open streams, over the client's connections."""
    result = facts.result
    workload = result.workload
    connections = max(1, (workload.client_processes or 1) * (workload.channels_per_process or 1))
    streams = workload.concurrency
    if not streams and result.timeline is not None:
        streams = result.timeline.concurrency.peak_open
    return math.ceil(streams / connections) if streams else None


def server_stream_limit(facts: RunFacts) -> list[Finding]:
    settings = facts.result.http2 or None
    limit = settings.max_concurrent_streams if settings is not None else None
    per_connection = streams_per_connection(facts)
    over = limit is not None and per_connection is not None and per_connection > limit
    refused = refused_calls(facts)
    if not (over or refused):
        return []
    workload = facts.result.workload
    connections = (workload.client_processes or 1) * (workload.channels_per_process or 1)
    evidence: dict = {
        "streams_per_connection": per_connection,
        "connections": connections,
        "server_max_concurrent_streams": limit,
        "refused_calls": refused,
    }
    parts = []
    if over:
        parts.append(
            f"the server lets one connection have {limit} streams open at once, and "
            f"the bench opened up to {per_connection} on each of its "
            f"{counted(connections, 'connection')}: the rest waited for a stream to end"
        )
    if refused:
        parts.append(
            f"{counted(refused, 'call')} {'was' if refused == 1 else 'were'} refused by the "
            "server (HTTP/2 REFUSED_STREAM, "
            "error code 7: over its concurrent-stream limit)"
        )
    needed = (
        math.ceil(connections * per_connection / limit)
        if over and limit and per_connection is not None
        else None
    )
    return [
        Finding(
            rule=RULE_SERVER_STREAM_LIMIT,
            finding="; ".join(parts),
            evidence=evidence,
            look_at=(
                "open more connections (cadence bench --channels "
                + (f"{math.ceil(needed / (workload.client_processes or 1))}" if needed else "N")
                + " per process), or raise the server's limit: grpc-python "
                "options=[('grpc.max_concurrent_streams', N)], grpc-go "
                "grpc.MaxConcurrentStreams(N), grpc-java maxConcurrentCallsPerConnection(N); "
                "a client library that opens one connection per target meets the same limit"
            ),
        )
    ]


SLOW_CONNECT_MS = 100.0
"""A connect p99 at least this long is slow: well past a loaded host's scheduling delays (a
dropped SYN costs its client a whole second, the first retransmit's timeout)."""
CONNECT_TTFT_SHARE = 0.3
"""...and it is a large part of TTFT when its p99 is at least this share of TTFT's p99."""


def slow_connect(facts: RunFacts) -> list[Finding]:
    result = facts.result
    connect, ttft = result.connect_ms or None, result.ttft_ms
    if connect is None or not connect.usable or not ttft.usable:
        return []
    if connect.p99 < SLOW_CONNECT_MS or connect.p99 < CONNECT_TTFT_SHARE * ttft.p99:
        return []
    after = result.ttft_after_connect_ms or None
    retried = connect.max >= 1000.0
    return [
        Finding(
            rule=RULE_SLOW_CONNECT,
            finding=(
                f"making the connections took much of the time to first token: connect p99 "
                f"{connect.p99:.0f} ms against TTFT p99 {ttft.p99:.0f} ms ({connect.count} "
                "requests opened a connection)"
                + (
                    "; the slowest took over a second, as a dropped SYN does (the client "
                    "resends it after 1 s, then 3 s)"
                    if retried
                    else ""
                )
            ),
            evidence={
                "connect_p50_ms": connect.p50,
                "connect_p99_ms": connect.p99,
                "connect_max_ms": connect.max,
                "connects": connect.count,
                "ttft_p99_ms": ttft.p99,
                "ttft_after_connect_p99_ms": after.p99 if after is not None else None,
            },
            look_at=(
                "the server's listen backlog (its listen() argument, capped by "
                "net.core.somaxconn) and SYN backlog: ListenOverflows and ListenDrops in "
                "/proc/net/netstat, TcpExt.TCPSynRetrans, before and after a run; how fast the "
                "server accepts while it streams (an event loop that accepts one connection "
                "per iteration leaves a burst in the accept queue, which shows in "
                "ttft_after_connect_ms instead); on the client, keep connections open "
                "(keep-alive) or open them before the burst"
            ),
        )
    ]


RULES = (Rule(RULE_SERVER_STREAM_LIMIT, server_stream_limit), Rule(RULE_SLOW_CONNECT, slow_connect))

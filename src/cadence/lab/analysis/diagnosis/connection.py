"""Rules on the client's connections to the server: `server_stream_limit` (the server's
HTTP/2 concurrent-stream limit is below the streams the client opens on one connection, so
the rest wait for a free stream or are refused)."""

from __future__ import annotations

import math

from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import RULE_SERVER_STREAM_LIMIT
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.results import Finding

REFUSED_TEXTS = ("REFUSED_STREAM", "error code 7")
"""How gRPC clients word a stream the server refused (HTTP/2 error code 7, REFUSED_STREAM)
in a call's error message."""


def refused_calls(facts: RunFacts) -> int:
    """Calls that ended with the server refusing their stream, by the run's error messages
    (each code's first message stands for that code's count)."""
    result = facts.result
    return sum(result.errors_by_code.get(code, 0)
               for code, message in result.first_error_by_code.items()
               if any(text in message for text in REFUSED_TEXTS))


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
    evidence: dict = {"streams_per_connection": per_connection, "connections": connections,
                      "server_max_concurrent_streams": limit, "refused_calls": refused}
    parts = []
    if over:
        parts.append(f"the server lets one connection have {limit} streams open at once, and "
                     f"the bench opened up to {per_connection} on each of its {connections} "
                     "connection(s): the rest waited for a stream to end")
    if refused:
        parts.append(f"{refused} call(s) were refused by the server (HTTP/2 REFUSED_STREAM, "
                     "error code 7: over its concurrent-stream limit)")
    needed = math.ceil(connections * per_connection / limit) if over and limit else None
    return [Finding(
        rule=RULE_SERVER_STREAM_LIMIT,
        finding="; ".join(parts),
        evidence=evidence,
        look_at=("open more connections (cadence bench --channels "
                 + (f"{math.ceil(needed / (workload.client_processes or 1))}" if needed else "N")
                 + " per process), or raise the server's limit: grpc-python "
                 "options=[('grpc.max_concurrent_streams', N)], grpc-go "
                 "grpc.MaxConcurrentStreams(N), grpc-java maxConcurrentCallsPerConnection(N); "
                 "a client library that opens one connection per target meets the same limit"),
    )]


RULES = (Rule(RULE_SERVER_STREAM_LIMIT, server_stream_limit),)

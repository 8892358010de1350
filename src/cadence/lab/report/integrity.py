"""Which integrity checks a run counted: a check its protocol cannot make is not a zero."""

from __future__ import annotations

from cadence.lab.results import Workload

CHECKS = ("lost_tokens", "repeated_tokens", "reordered_chunks", "short_streams")
"""The integrity counts of a result, in the order they are shown."""
_POSITIONS = CHECKS[:3]
"""The checks read from each chunk's position in its stream."""


def counted_checks(workload: Workload) -> tuple[str, ...]:
    """The checks the run behind `workload` counted. Any gRPC service (`--protocol grpc`)
    knows positions only from `--index-field`, and never why a stream ended, so it counts
    no short stream; every other protocol counts all."""
    if not workload.grpc:
        return CHECKS
    return _POSITIONS if workload.grpc.index_field else ()

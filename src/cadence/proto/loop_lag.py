"""The front's event-loop lag as a timed cadence.v1 stream carries it: metadata `KEY`, in the
trailing metadata and (when it moved since a stream last carried it) the initial metadata,
valued `FRONT:SAMPLES:C0,C1,...`: the front's index, its lag samples so far and their count
per bucket of `BOUNDS_S` (the buckets of `cadence_event_loop_lag_seconds`), then above them
all. The server writes it (`cadence.core.metrics.LoopLagTally`), the lab reads it
(`cadence.lab.analysis.stats.front_loop`)."""

from __future__ import annotations

from collections.abc import Sequence

KEY = "cadence-loop-lag"
BOUNDS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def encode(front: int, samples: int, counts: Sequence[int]) -> str:
    """`FRONT:SAMPLES:C0,C1,...` (per-bucket counts in the order of BOUNDS_S, then +Inf)."""
    return f"{front}:{samples}:{','.join(map(str, counts))}"


def front(tally: str) -> int:
    """The front an encoded tally came from."""
    return int(tally.partition(":")[0])


def counts(tally: str) -> list[int]:
    """The per-bucket counts of an encoded tally."""
    return [int(c) for c in tally.rsplit(":", 1)[1].split(",")]

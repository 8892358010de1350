"""The garbage collector's settings for cadence's long-running processes.

CPython's cyclic collector pauses the whole process while it runs. A full (generation 2)
pass walks every tracked object, and after start-up a front holds hundreds of thousands
(protobuf descriptors, gRPC, prometheus, imported modules), so each full pass is a stall of
every stream the front serves, tens of milliseconds long (benchmarks/serving_overhead.py's
W1 shows them). None of those start-up objects ever becomes garbage.

`settle_heap` is called once, when start-up is over: one collection, then `gc.freeze()`
moves every surviving object to the permanent generation, which later passes skip, so a full
pass costs only what was allocated since. The young generation's threshold is raised too:
the per-token path allocates protobuf messages, futures and lists that reference counting
frees, and a collection every 700 net allocations (the default) ran hundreds of times per
run. Reference cycles are still collected, just in larger, rarer batches.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Net allocations of tracked objects between two young-generation collections (default 700)."""


def settle_heap() -> None:
    """Collect once and freeze what survives start-up (see the module docstring)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)

"""Chooses the worker for each request: the least outstanding work among live workers, or,
with prefix-aware routing, the worker that holds the longest prefix of the prompt while it is
not much busier than the least loaded."""

from __future__ import annotations

import time

from cadence.config import ServerConfig
from cadence.prefix_hash import BLOCK
from cadence.router.prefix_index import PrefixIndex


class NoWorkerAvailable(Exception):
    """Every worker has died."""


class WorkerRouter:
    """Tracks the outstanding work of each worker, in tokens still to generate at most.

    Work is counted when a request is assigned (its max_tokens) and released when it ends,
    however it ends. Ties go to the worker after the last one chosen, so equal requests
    spread evenly.

    With a `PrefixIndex` (`--prefix-caching`, `--routing prefix`) the policy is: among the
    live workers with at most `slack` open requests more than the least loaded one, the one
    whose cached blocks cover the longest prefix of the prompt; with no such prefix anywhere
    (or only on workers past the slack), the least outstanding work as without. So turn N+1
    of a conversation goes where turn N went, unless that worker is `slack` requests behind.
    """

    def __init__(self, workers: int, prefixes: PrefixIndex | None = None, slack: int = 4) -> None:
        self.load = [0] * workers
        self.requests = [0] * workers
        self.alive = [True] * workers
        self.busy_since_ns = [0] * workers
        """When each worker last went from no request to one: the hang check's clock starts
        there, not at an output from before an idle spell."""
        self._next = 0
        self.prefixes = prefixes
        """Prompts sent to each worker, for prefix-aware routing; None: load only."""
        self.slack = slack

    def pick(self, hashes: list[bytes] | None = None, pool: range | None = None) -> int:
        """The worker for a request whose prompt's block hashes are `hashes` (None or empty:
        by load only), among the workers of `pool` (None: all; disaggregated serving: the
        prefill or the decode workers); records the prompt as held there."""
        n = len(self.load)
        best = -1
        for k in range(n):
            i = (self._next + k) % n
            if (
                self.alive[i]
                and (pool is None or i in pool)
                and (best < 0 or self.load[i] < self.load[best])
            ):
                best = i
        if best < 0:
            raise NoWorkerAvailable("no worker is running")
        prefixes = self.prefixes
        if hashes and prefixes is not None:
            best = self._by_prefix(hashes, best, prefixes, range(n) if pool is None else pool)
            prefixes.record(best, hashes)
        self._next = (best + 1) % n
        return best

    def _by_prefix(
        self, hashes: list[bytes], least: int, prefixes: PrefixIndex, pool: range
    ) -> int:
        requests, alive = self.requests, self.alive
        ceiling = min(requests[i] for i in pool if alive[i]) + self.slack
        chosen, longest = least, 0
        for i in pool:
            if alive[i] and requests[i] <= ceiling:
                held = prefixes.match(i, hashes)
                if held > longest or (
                    held == longest and held and self.load[i] < self.load[chosen]
                ):
                    chosen, longest = i, held
        return chosen

    def assign(self, worker: int, work: int) -> None:
        if not self.requests[worker]:
            self.busy_since_ns[worker] = time.monotonic_ns()
        self.load[worker] += work
        self.requests[worker] += 1

    def release(self, worker: int, work: int) -> None:
        self.load[worker] -= work
        self.requests[worker] -= 1

    def mark_dead(self, worker: int) -> None:
        self.alive[worker] = False
        if self.prefixes is not None:
            self.prefixes.forget(worker)


def router_for(config: ServerConfig) -> WorkerRouter:
    """The router the server's flags ask for: prefix-aware with `--prefix-caching` and
    `--routing prefix` on more than one worker, by load otherwise."""
    workers = len(config.devices)
    prefixes = None
    if config.engine.prefix_caching and config.routing == "prefix" and workers > 1:
        prefixes = PrefixIndex(workers, config.engine.kv_cache_tokens // BLOCK)
    return WorkerRouter(workers, prefixes, config.prefix_routing_slack)

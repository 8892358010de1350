"""What a worker's step loop says of its own health, for front 0's supervisor: how long it has
had something to step without finishing a step (the heartbeat carries it: the hang check,
`--worker-timeout`), and how many engine steps in a row failed (`StepsFailing`, sent once at
`--worker-max-failed-steps`: the sickness check).

The worker judges neither: it only reports, so that front 0 sees the work of every front
(with `--fronts N` a sequence's outputs and failures go to its own front only).
"""

from __future__ import annotations

import time

from cadence.transport.messages import StepsFailing


class StepHealth:
    """Kept by the step loop (`before_step`, then `stepped` or `failed`); `stalled_ns` is read
    on the heartbeat's thread (one attribute, written whole under the GIL)."""

    def __init__(self, worker: int, max_failed_steps: int) -> None:
        self._worker = worker
        self._max_failed = max_failed_steps
        self._waiting_since_ns = 0
        """Since when the loop has had something to step and finished no step (0: not)."""
        self.failed_in_a_row = 0

    def before_step(self, has_work: bool) -> None:
        if not has_work:
            self._waiting_since_ns = 0  # idle: the hang clock does not run
        elif not self._waiting_since_ns:
            self._waiting_since_ns = time.monotonic_ns()

    def stepped(self) -> None:
        """A step finished with outputs."""
        self._waiting_since_ns = 0
        self.failed_in_a_row = 0

    def failed(self, message: str) -> StepsFailing | None:
        """The engine lost a step (its sequences failed): the report for the fronts once
        this makes `max_failed_steps` in a row, else None."""
        self._waiting_since_ns = 0  # not hung: it answered
        self.failed_in_a_row += 1
        if self.failed_in_a_row == self._max_failed:
            return StepsFailing(self._worker, self.failed_in_a_row, message)
        return None

    def stalled_ns(self) -> int:
        """How long the loop has had work without finishing a step (0: none to step)."""
        since = self._waiting_since_ns
        return time.monotonic_ns() - since if since else 0

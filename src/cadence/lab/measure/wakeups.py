"""How late a sleeping thread wakes on this host during a run: the most the host's scheduling
adds to one hop of a token's way (the engine's step timer, the front's loop, the client's
read), measured rather than assumed.

`WakeupProbe` runs this module as its own small process (a thread of the lab's process would
also wait for its GIL): it sleeps `PERIOD_S` at a time and keeps how much later than asked
each sleep ended, until it is told to stop (SIGTERM); then it prints the summary as JSON.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from array import array

import msgspec

from cadence.lab.percentile import distribution
from cadence.lab.results import Distribution

PERIOD_S = 0.005
"""Between wake-ups: 200 a second, a fraction of a percent of a core."""
MOST = 500_000
"""Wake-ups kept at most (40 minutes); later ones are not measured."""


class WakeupProbe:
    """The probe process, from `start` to `stop`."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def start(self) -> WakeupProbe:
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "cadence.lab.measure.wakeups"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            self._process = None  # no probe: the run goes on without the measure
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def stop(self) -> Distribution | None:
        """The wake-ups measured; None when the probe did not run."""
        process, self._process = self._process, None
        if process is None:
            return None
        process.terminate()
        try:
            out, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            return None
        try:
            return msgspec.json.decode(out, type=Distribution) if out else None
        except msgspec.DecodeError:
            return None


def main() -> None:
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    late = array("d")
    while not stopped and len(late) < MOST:
        t = time.perf_counter()
        time.sleep(PERIOD_S)
        if not stopped:  # the stop's signal ends a sleep early
            late.append(max(0.0, 1e3 * (time.perf_counter() - t - PERIOD_S)))
    sys.stdout.buffer.write(msgspec.json.encode(distribution(late)))


if __name__ == "__main__":
    main()

"""Model classes whose start-up the start-up tests control (`cadence serve --engine
tests.startup_models:NAME`); worker processes import this module from the repository root.

`SlowLoadModel` loads for the seconds `STARTUP_MODEL_LOAD_S` gives its worker: a
space-separated list, one value per worker index (a worker past its end loads at once), so
that "worker 0 ready, worker 1 still loading for a minute" is a command line away.
"""

from __future__ import annotations

import os
import time

from tests.batched_models import EchoModel

LOAD_ENV = "STARTUP_MODEL_LOAD_S"


class SlowLoadModel(EchoModel):
    def __init__(self, device: str, worker: int) -> None:
        super().__init__(device)
        loads = os.environ.get(LOAD_ENV, "").split()
        time.sleep(float(loads[worker]) if worker < len(loads) else 0.0)

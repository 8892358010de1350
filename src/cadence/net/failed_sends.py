"""Sends that failed because the client left at the same moment: counted, not logged.

When a client cancels while the front has a message in flight to it, the send fails in gRPC's
core. grpc.aio ignores that failure if it has already seen the cancellation, and otherwise
logs it as an error with a traceback ("ExecuteBatchError raised in core by servicer method"),
which of the two is a race. Either way the stream is gone, its handler has ended and its slot
is free (the soak test checks that), so the traceback says nothing an operator can act on and
drowns real errors under a storm of cancels. This filter drops those records from the logger
grpc.aio uses and counts them in `cadence_failed_sends_total` instead.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

GRPC_LOGGER = "grpc._cython.cygrpc"
_MESSAGE = "ExecuteBatchError raised in core by servicer method"


class FailedSendFilter(logging.Filter):
    """Drops grpc.aio's failed-send tracebacks and counts them (see the module docstring)."""

    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self._counter = counter

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_MESSAGE):
            self._counter.inc()
            return False
        return True


def count_failed_sends(counter: Counter) -> FailedSendFilter:
    """Install the filter on grpc.aio's logger; returns it, to remove it at shutdown."""
    installed = FailedSendFilter(counter)
    logging.getLogger(GRPC_LOGGER).addFilter(installed)
    return installed

"""grpc.aio's failed-send tracebacks (a client cancelling mid-send) are counted, not logged."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from cadence.net.failed_sends import GRPC_LOGGER, count_failed_sends


def test_failed_send_tracebacks_are_dropped_and_counted(caplog):
    counter = Counter("failed_sends", "test", registry=CollectorRegistry())
    installed = count_failed_sends(counter)
    logger = logging.getLogger(GRPC_LOGGER)
    try:
        with caplog.at_level(logging.DEBUG, logger=GRPC_LOGGER):
            try:
                raise RuntimeError('Failed "execute_batch"')
            except RuntimeError:
                # As grpc.aio's _handle_exceptions logs it.
                logger.exception(
                    "ExecuteBatchError raised in core by servicer method [%s]",
                    "/cadence.v1.Inference/Generate",
                )
            logger.error("a real gRPC error")
    finally:
        logger.removeFilter(installed)
    assert [r.getMessage() for r in caplog.records] == ["a real gRPC error"]
    assert counter._value.get() == 1

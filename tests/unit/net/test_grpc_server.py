"""The front's gRPC server says, in its log and its metrics, whether calls are taken in ahead."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from cadence.config import ServerConfig
from cadence.core.metrics import FrontMetrics
from cadence.net import call_acceptor
from cadence.net.grpc_server import GrpcServer


async def _stream(request: bytes, context) -> None:
    yield request


def _services() -> dict[str, dict[str, grpc.RpcMethodHandler]]:
    return {"test.Echo": {"Stream": grpc.unary_stream_rpc_method_handler(_stream)}}


def _accept_ahead_after_start(accept_ahead: int = 64) -> float:
    metrics = FrontMetrics()

    async def main() -> None:
        server = GrpcServer(ServerConfig(port=0, accept_ahead=accept_ahead), _services(), metrics)
        assert await server.start() > 0
        await server.stop()

    asyncio.run(main())
    return metrics.registry.get_sample_value("cadence_accept_ahead_calls")


def test_the_metric_reads_the_depth_when_calls_are_taken_in_ahead(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="cadence.front"):
        assert _accept_ahead_after_start() == 64
    assert "--accept-ahead is off" not in caplog.text


def test_a_grpcio_without_those_internals_is_said_in_the_log_and_the_metric(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setattr(call_acceptor, "supported", lambda server: False)
    with caplog.at_level(logging.WARNING, logger="cadence.front"):
        assert _accept_ahead_after_start() == 0
    assert "--accept-ahead is off" in caplog.text and grpc.__version__ in caplog.text


def test_grpcio_is_bounded_to_the_minor_version_the_acceptor_is_tested_on() -> None:
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert '"grpcio>=1.85.1,<1.86"' in pyproject
    assert grpc.__version__.startswith("1.85."), "test the acceptor, then move the bound"

"""The lab against `cadence serve --fronts 2`: every front and worker sampled, every front's
counters scraped, and health and reflection answered by a child front too."""

from __future__ import annotations

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc

_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""A channel of its own: a new TCP connection, which the kernel gives to either front."""


def test_bench_samples_every_front_and_worker_and_scrapes_all_fronts(server_factory) -> None:
    server = server_factory(
        "--fronts", "2", "--metrics-port", "0", "--devices", "cpu:2", "--step-ms", "5"
    )
    # 16 connections: all on one front by chance is 2 in 65536.
    workload = Workload(requests=32, concurrency=16, shape=RequestShape(max_tokens=(20, 20)))
    result = run_bench(server.target, workload, channels=16)
    assert result.requests_ok == 32 and result.errors_by_code == {}
    assert result.output_tokens == 32 * 20

    processes = result.system.processes
    assert {"front0", "front1", "worker0", "worker1", "client0"} <= set(processes), processes
    assert "front" not in processes
    assert processes["front0"].pid == server.front.pid
    child = psutil.Process(processes["front1"].pid)
    if child.name() == "envoy":  # --grpc-server native: the child front's process started it
        child = child.parent()
    assert "cadence.lifecycle.front_child" in child.cmdline()
    assert child.ppid() == server.front.pid
    for name in ("worker0", "worker1"):
        assert "cadence.worker" in psutil.Process(processes[name].pid).cmdline()
    assert all(processes[n].samples for n in ("front0", "front1", "worker0", "worker1"))

    # Front 0's endpoint: the all-fronts totals under the plain names, and each front's own.
    scraped = result.system.server_metrics
    assert scraped.during_run["cadence_output_tokens_total"] == result.output_tokens
    assert scraped.during_run["cadence_chunks_total"] == result.chunks
    first, last = scraped.samples[0][1], scraped.samples[-1][1]
    per_front = [
        last[f"cadence_output_tokens_total{{front={k}}}"]
        - first.get(f"cadence_output_tokens_total{{front={k}}}", 0.0)
        for k in (0, 1)
    ]
    assert sum(per_front) == result.output_tokens
    assert all(tokens > 0 for tokens in per_front), per_front


def _front_of(channel: grpc.Channel) -> tuple[int, int]:
    """(front, pid) of the front holding this channel's connection, from a stream's metadata."""
    call = pb_grpc.InferenceStub(channel).Generate(
        pb.GenerateRequest(prompt="which front", max_tokens=1), timeout=10
    )
    metadata = dict(call.initial_metadata())
    assert len(list(call)) >= 1
    return int(metadata["cadence-front"]), int(metadata["cadence-front-pid"])


def test_health_and_reflection_answer_on_the_child_front(server_factory) -> None:
    server = server_factory("--fronts", "2", "--devices", "cpu:2", "--step-ms", "5")
    seen: dict[int, int] = {}
    for _ in range(40):
        channel = grpc.insecure_channel(server.target, options=_OWN_CONNECTION)
        try:
            # Every call on this channel goes over its one connection, so to the same front.
            front, pid = _front_of(channel)
            if front in seen:
                continue
            seen[front] = pid
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "cadence.v1.Inference", "cadence.worker.0", "cadence.worker.1"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (front, service)
            requests = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="cadence.v1.Inference"
                ),
            ]
            listed, described = list(
                reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter(requests), timeout=10
                )
            )
            names = {s.name for s in listed.list_services_response.service}
            assert {
                "cadence.v1.Inference",
                "inference.GRPCInferenceService",
                "grpc.health.v1.Health",
            } <= names, (front, names)
            assert described.file_descriptor_response.file_descriptor_proto, front
            assert _front_of(channel) == (front, pid)  # still the same connection
        finally:
            channel.close()
        if len(seen) == 2:
            break
    assert set(seen) == {0, 1}, f"no connection out of 40 landed on front 1: {seen}"
    assert seen[0] == server.front.pid and seen[1] != server.front.pid

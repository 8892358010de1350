"""The worker process: I/O plus one busy loop (read inputs, step, emit)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import msgspec

from cadence.engines.base import Engine
from cadence.transport.channel import WorkerChannel
from cadence.transport.messages import (
    EngineConfig,
    Shutdown,
    WorkerInputs,
    WorkerReady,
    WorkerSpec,
)
from cadence.worker.batch_scheduler import BatchScheduler


def build_engine(config: EngineConfig, device: str) -> Engine:
    """The engine named in `config`, on `device`."""
    if config.name == "synthetic":
        from cadence.engines.synthetic import SyntheticEngine

        return SyntheticEngine(config)
    raise ValueError(f"unknown engine {config.name!r}; choose 'synthetic'")


def run_worker(spec: WorkerSpec) -> None:
    """Build the engine, report ready, then step until told to shut down."""
    engine = build_engine(spec.engine, spec.device)
    engine.start()
    channel = WorkerChannel(spec.input_address, spec.output_address)
    scheduler = BatchScheduler(engine, spec.index, spec.engine.max_batch)
    channel.send(WorkerReady(spec.index, os.getpid(), engine.name))
    try:
        while True:
            # Block only when there is nothing to step; otherwise take what has arrived
            # and go straight to the next step boundary.
            for message in channel.receive(0 if scheduler.has_work else None):
                if isinstance(message, Shutdown):
                    return
                assert isinstance(message, WorkerInputs)
                # Adds first: a request cancelled in the same event-loop tick as it was
                # sent arrives with its abort in one message.
                for request in message.adds:
                    failure = scheduler.add(request)
                    if failure is not None:
                        channel.send(failure)
                if message.aborts:
                    scheduler.abort(message.aborts)
            output = scheduler.step()
            if output is not None:
                channel.send(output)
    finally:
        channel.close()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the front dies, so no worker is orphaned."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        return


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m cadence.worker SPEC_JSON`."""
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    parent = os.getppid()
    # Ctrl-C belongs to the front, which shuts workers down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if parent == 1:  # the front died before prctl took effect
        return
    run_worker(msgspec.json.decode(argv[0].encode(), type=WorkerSpec))

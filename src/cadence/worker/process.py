"""The worker process: I/O plus one busy loop (read inputs, step, emit)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec

from cadence.config import EngineConfig, WorkerSpec
from cadence.engines.base import EngineLoadError, Follower
from cadence.engines.engine import Engine
from cadence.heap import settle_heap
from cadence.transport.heartbeat import WorkerHeartbeat
from cadence.transport.messages import Shutdown, WorkerInputs, WorkerReady, boot_id
from cadence.transport.sockets import remove_ipc_sockets
from cadence.transport.worker_to_fronts import worker_channel
from cadence.worker import bind_to_starter, starter_gone
from cadence.worker.batch_scheduler import BatchScheduler
from cadence.worker.cpu_wait import CpuWait, thread_ids
from cadence.worker.step_budget import StepBudget, budget_for
from cadence.worker.step_health import StepHealth


def build_engine(
    config: EngineConfig,
    device: str,
    *,
    rank: int = 0,
    group_size: int = 1,
    dist_init: str = "",
    worker: int = 0,
) -> Engine:
    """The engine named in `config`, on `device` (one rank of a tensor-parallel group when
    `group_size` > 1), for worker number `worker`."""
    if config.name == "synthetic":
        from cadence.engines.synthetic import SyntheticEngine

        return SyntheticEngine(config, worker)
    if config.name == "torch":
        from cadence.engines.llama.engine import LlamaEngine

        return LlamaEngine(config, device, rank=rank, group_size=group_size, dist_init=dist_init)
    if config.name == "transformers":
        import msgspec

        from cadence.engines.transformers_model import TRANSFORMERS_MODEL
        from cadence.engines.user_model import ModelEngine

        if config.threads > 0 and device.startswith("cpu"):
            import torch

            torch.set_num_threads(config.threads)
        # Served as the user's model class it is (docs/models.md, "Any transformers model").
        config = msgspec.structs.replace(config, model_class=TRANSFORMERS_MODEL)
        return ModelEngine(config, device, worker=worker)
    if config.name == "model":
        from cadence.engines.user_model import ModelEngine

        return ModelEngine(
            config, device, rank=rank, group_size=group_size, dist_init=dist_init, worker=worker
        )
    raise ValueError(
        f"unknown engine {config.name!r}; choose 'synthetic', 'torch', "
        "'transformers', 'app' or MODULE:CLASS"
    )


_BLOCKED_POLL_MS = 5


def run_worker(spec: WorkerSpec) -> None:
    """Build the engine, report ready, then step until told to shut down."""
    if spec.engine.name == "app":
        # A user's generator function: an event loop and its own executor, not a step loop.
        from cadence.worker.app_runner import run_app_worker

        heartbeat = start_heartbeat(spec)
        try:
            run_app_worker(spec)
        finally:
            if heartbeat is not None:
                heartbeat.stop()
        return
    load_start = time.perf_counter()
    before_engine = thread_ids()
    try:
        engine = build_engine(
            spec.engine,
            spec.device,
            rank=spec.rank,
            group_size=spec.group_size,
            dist_init=spec.dist_init,
            worker=spec.index,
        )
    except EngineLoadError as exc:  # one line that says what to fix, not a traceback
        sys.exit(f"cadence worker {spec.index} (rank {spec.rank}): {exc}")
    if spec.rank > 0:
        # A tensor-parallel follower talks to no front: it runs the steps its rank 0
        # broadcasts, and only listens for the front's heartbeat (a follower on another host
        # would otherwise wait in a collective forever once the link to its rank 0 is cut).
        start_heartbeat(spec, send=False)
        if not isinstance(engine, Follower):
            sys.exit(
                f"cadence worker {spec.index} (rank {spec.rank}): the {spec.engine.name} "
                "engine does not run tensor-parallel; serve it without --tp"
            )
        engine.follow()
        return
    if spec.role and not engine.hands_off_state():
        sys.exit(
            f"cadence worker {spec.index} (rank {spec.rank}): {engine.name} cannot be served "
            "disaggregated (--prefill-devices, --decode-devices): it has no export_state and "
            "import_state (docs/models.md)"
        )
    warmup_start = time.perf_counter()
    engine.start()
    ready = time.perf_counter()
    # Before the transport's and the heartbeat's threads are born: they are not the step's.
    cpu_wait = CpuWait.of_engine(before_engine)
    channel = worker_channel(spec)
    health = StepHealth(spec.index, spec.max_failed_steps)
    heartbeat = start_heartbeat(spec, stalled=health.stalled_ns)
    budget = budget_for(spec.engine, spec.index)
    if budget is not None:
        announce_budget(budget, engine, spec.index)
    scheduler = BatchScheduler(
        engine,
        spec.index,
        min(engine.max_batch or spec.engine.max_batch, spec.engine.max_batch),
        budget,
        preempt=spec.engine.preempt,
        report_cached=bool(spec.engine.prefix_caching),  # (a bool once the config is built)
        max_prompt_tokens=spec.max_prompt_tokens,
        role=spec.role,
        cpu_wait=cpu_wait,
    )
    settle_heap()
    channel.send(
        WorkerReady(
            spec.index,
            os.getpid(),
            engine.name,
            load_ms=(warmup_start - load_start) * 1e3,
            warmup_ms=(ready - warmup_start) * 1e3,
            first_step_ms=engine.first_step_ms,
            warm_step_ms=engine.warm_step_ms,
            boot_id=boot_id(),
        )
    )
    stepped = False
    try:
        while True:
            # Block only when there is nothing to step; otherwise take what has arrived
            # and go straight to the next step boundary. Work that cannot step (every
            # running sequence paused, the rest waiting for cache) waits for an input, with a
            # short timeout, instead of spinning.
            if not scheduler.has_work:
                timeout = None
            else:
                timeout = 0 if stepped else _BLOCKED_POLL_MS
            for message in channel.receive(timeout):
                if isinstance(message, Shutdown):
                    return
                assert isinstance(message, WorkerInputs)
                # Adds first: a request cancelled in the same event-loop tick as it was
                # sent arrives with its abort in one message.
                for request in message.adds:
                    failure = scheduler.add(request)
                    if failure is not None:
                        channel.send(failure)
                for handed in message.imports:
                    failure = scheduler.add_import(handed)
                    if failure is not None:
                        channel.send(failure)
                if message.aborts:
                    scheduler.abort(message.aborts)
                if message.pauses:
                    scheduler.pause(message.pauses)
                if message.resumes:
                    scheduler.resume(message.resumes)
            if channel.newly_gone:
                # --fronts N: a front died; its sequences have no one to stream to.
                gone, n = set(channel.newly_gone), channel.fronts
                channel.newly_gone.clear()
                scheduler.abort([s for s in scheduler.seq_ids() if s % n in gone])
            health.before_step(scheduler.has_work)
            output = scheduler.step()
            stepped = output is not None
            if isinstance(output, list):  # the engine lost the step: its sequences failed
                for failure in output:
                    channel.send(failure)
                sick = health.failed(output[0].message if output else "")
                if sick is not None:
                    channel.send(sick)
            elif output is not None:
                health.stepped()
                channel.send(output)
                if spec.role == "prefill":  # after the first tokens: they go out at once
                    for state in scheduler.export_states():
                        channel.send(state)
            if scheduler.failed:  # sequences the step lost alone (their tokenizer's fault)
                for failure in scheduler.failed:
                    channel.send(failure)
                scheduler.failed.clear()
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        channel.close()
        engine.close()
        if cpu_wait is not None:
            cpu_wait.close()


def announce_budget(budget: StepBudget, engine: Engine, worker: int) -> None:
    """Say once which budget the worker steps under; its later changes (--itl-target-ms)
    are logged by cadence.worker.step_budget. Workers configure no logging of their own, so
    the budget's logger gets its own handler on stderr."""
    log = logging.getLogger("cadence.budget")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s worker-{worker} %(name)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    chunks = (
        "in chunks"
        if engine.takes_prefill_chunks
        else ("whole (this engine takes no prefill chunks)")
    )
    log.info("worker %d: %s; prompts prefilled %s", worker, budget.describe(), chunks)


def start_heartbeat(
    spec: WorkerSpec, *, send: bool = True, stalled: Callable[[], int] | None = None
) -> WorkerHeartbeat | None:
    """Beat to the front and exit once it has been silent too long (see `WorkerHeartbeat`);
    `stalled`: the step loop's stall clock, carried by each beat."""
    if not spec.heartbeat_address:
        return None

    def lost() -> None:
        print(
            f"cadence worker {spec.index} (rank {spec.rank}): no heartbeat from the front "
            f"for {spec.heartbeat_timeout_s:g} s; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)  # the engine loop may be blocked in a send or a collective

    heartbeat = WorkerHeartbeat(spec, lost, send=send, stalled=stalled)
    heartbeat.start()
    return heartbeat


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m cadence.worker SPEC_JSON`."""
    argv = sys.argv[1:] if argv is None else argv
    parent = bind_to_starter()
    # Ctrl-C belongs to the front, which shuts workers down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is None:  # the front died before it could take this worker with it
        return
    spec = msgspec.json.decode(argv[0].encode(), type=WorkerSpec)

    def on_sigterm(*_) -> None:
        if starter_gone(parent):
            # The front is gone (killed) and could not remove its socket files.
            remove_ipc_sockets(
                [
                    spec.input_address,
                    spec.output_address,
                    spec.heartbeat_address,
                    *spec.extra_input_addresses,
                    *spec.front_output_addresses,
                ]
            )
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    if spec.rank > 0:
        # A follower spends its idle time blocked inside a collective, where a Python signal
        # handler would never run; it holds nothing to clean up, so SIGTERM ends it at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    run_worker(spec)

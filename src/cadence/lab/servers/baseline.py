"""Engine-only baseline: the bench's workload through the same engine and batching loop,
with no gRPC, no sockets and no front, so serving overhead = served − engine-only.

Each worker of the measured server is replayed in its own process with its own share of
the requests (as the router would spread them); a token "arrives" when its step ends.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import psutil

from cadence.config import EngineConfig
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.processes import ProcessPlan, my_requests
from cadence.lab.records import RequestRecord
from cadence.vocabulary import AddRequest

if TYPE_CHECKING:
    from cadence.transport.messages import RequestFailed


def engine_config_of(target: str) -> tuple[EngineConfig, int] | None:
    """The engine config and worker count of a server running on this host, read from its
    worker processes' command lines; None when the server is not local."""
    from cadence.lab.measure.discovery import server_processes

    pids = server_processes(target)
    specs = []
    for name, pid in pids.items():
        if name.startswith("worker") and ".rank" not in name:  # one per worker, not per rank
            cmdline = psutil.Process(pid).cmdline()
            specs.append(json.loads(cmdline[-1]))
    if not specs:
        return None
    return msgspec.convert(specs[0]["engine"], EngineConfig), len(specs)


def replay(
    config: EngineConfig,
    shape: RequestShape,
    requests: int | None,
    duration_s: float | None,
    concurrency: int,
    rate: float | None,
    worker: int,
    workers: int,
) -> list[RequestRecord]:
    """Run this worker's share of the workload through the engine alone."""
    from cadence.worker.batch_scheduler import BatchScheduler
    from cadence.worker.process import build_engine

    engine = build_engine(config, "cpu", worker=worker)
    engine.start()
    scheduler = BatchScheduler(engine, worker, config.max_batch)
    # The same request sequence and arrival schedule as the bench, this worker's share.
    plan = ProcessPlan(
        process=worker,
        processes=workers,
        target="",
        shape=shape,
        requests=requests,
        duration_s=duration_s,
        rate=rate,
    )
    todo = deque(my_requests(plan))
    lanes = max(1, len(range(worker, concurrency, workers)))
    records: dict[int, RequestRecord] = {}
    t0 = time.monotonic_ns()
    stop_at = t0 + int(duration_s * 1e9) if duration_s else None

    def admit(now: int) -> None:
        i, _ = todo.popleft()
        req = shape.request(i)
        records[i] = RequestRecord(
            request_id=req.request_id,
            process=worker,
            start_ns=now,
            max_tokens=req.max_tokens,
            prompt_tokens=len(req.prompt_token_ids),
        )
        scheduler.add(AddRequest(i, req.prompt_token_ids, req.max_tokens))

    open_now = 0
    if rate is None:
        while todo and open_now < lanes:
            admit(t0)
            open_now += 1
    while todo or scheduler.has_work:
        now = time.monotonic_ns()
        if rate is not None:
            while todo and t0 + todo[0][1] * 1e9 <= now:
                admit(int(t0 + todo[0][1] * 1e9))
            if not scheduler.has_work and todo:
                time.sleep(max(0.0, (t0 + todo[0][1] * 1e9 - now) / 1e9))
                continue
        out = scheduler.step()
        if out is None:
            continue
        if isinstance(out, list):  # the engine lost the step: every sequence in it failed
            raise _lost_step(out)
        for seq_id in out.seq_ids:
            r = records[seq_id]
            r.index.append(len(r.tokens))
            r.tokens.append(1)
            r.arrival_ns.append(out.end_ns)
        for seq_id, reason in zip(out.finished_ids, out.finish_reasons):
            r = records[seq_id]
            r.finish_reason = reason
            r.end_ns = out.end_ns
            if rate is None and todo and (stop_at is None or out.end_ns < stop_at):
                admit(out.end_ns)
    return list(records.values())


def _lost_step(failures: list[RequestFailed]) -> RuntimeError:
    return RuntimeError(
        "the engine failed a step of the baseline: "
        + "; ".join(dict.fromkeys(f.message for f in failures))
    )


def _replay_main(args: bytes, conn) -> None:
    kw = msgspec.msgpack.decode(args)
    kw["config"] = msgspec.convert(kw["config"], EngineConfig)
    kw["shape"] = msgspec.convert(kw["shape"], RequestShape)
    conn.send_bytes(msgspec.msgpack.encode(replay(**kw)))
    conn.close()


def run_baseline(
    config: EngineConfig,
    workers: int,
    shape: RequestShape,
    requests: int | None,
    duration_s: float | None,
    concurrency: int,
    rate: float | None,
) -> list[RequestRecord]:
    """Replay every worker's share at once, each in its own process, like the server runs."""
    context = mp.get_context("spawn")
    running = []
    for w in range(workers):
        receiver, sender = context.Pipe(duplex=False)
        kw = {
            "config": config,
            "shape": shape,
            "requests": requests,
            "duration_s": duration_s,
            "concurrency": concurrency,
            "rate": rate,
            "worker": w,
            "workers": workers,
        }
        proc = context.Process(target=_replay_main, args=(msgspec.msgpack.encode(kw), sender))
        proc.start()
        sender.close()
        running.append((proc, receiver))
    decode = msgspec.msgpack.Decoder(list[RequestRecord]).decode
    records: list[RequestRecord] = []
    for proc, receiver in running:
        records.extend(decode(receiver.recv_bytes()))
        proc.join()
    return records

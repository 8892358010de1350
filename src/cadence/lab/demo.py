"""`cadence demo`: start a CPU server, stream a few requests, run a short bench, explain."""

from __future__ import annotations

import time

from rich.console import Console

from cadence.client import Client
from cadence.lab.bench import Workload, run_bench
from cadence.lab.load.plan import RequestShape
from cadence.lab.report.summary import print_summary
from cadence.lab.servers.server_process import ServerProcess


def run_demo(workers: int = 2, step_ms: float = 20.0, streams: int = 64) -> None:
    console = Console()
    args = ("--devices", f"cpu:{workers}", "--step-ms", str(step_ms))
    console.print(f"[bold]Starting[/] cadence serve {' '.join(args)} (synthetic engine, CPU)")
    with ServerProcess(*args) as server:
        console.print(f"serving on {server.target}; health and reflection on the same port\n")
        with Client(server.target) as client:
            for prompt in ("Hello, cadence", "Stream every token", "as soon as it exists"):
                console.print(f"[bold]>[/] {prompt}")
                t0 = time.monotonic()
                first = None
                chunks = tokens = 0
                for chunk in client.generate(prompt, max_tokens=48, include_timing=True):
                    first = first or time.monotonic() - t0
                    chunks += 1
                    tokens += len(chunk.token_ids)
                    console.out(chunk.text, end="", highlight=False)
                shown = "no chunk" if first is None else f"{first * 1e3:.1f} ms"
                console.print(
                    f"\n  [dim]{tokens} tokens in {chunks} chunks, first after {shown}, "
                    f"all after {(time.monotonic() - t0) * 1e3:.0f} ms (step {step_ms:g} ms)[/]"
                )
        console.print(f"\n[bold]Short bench:[/] {streams} streams of 64 tokens starting together")
        workload = Workload(
            requests=streams, concurrency=streams, shape=RequestShape(max_tokens=(64, 64))
        )
        result = run_bench(server.target, workload)
        print_summary(result)
    console.print("server stopped; no process left behind")

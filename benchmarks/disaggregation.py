"""Disaggregated serving (issue 54) against colocated workers and chunked prefill, in one
sitting: long prompts (16-3,000 tokens) arriving open loop among decoding streams, on 2 and 4
synthetic workers, with goodput under an SLO on TTFT and ITL; and a sweep of
`--disaggregate-above`.

The setups, the same load on each (per worker, so a 4-worker setup gets twice a 2-worker's):

- 2 workers: colocated `--devices cpu:2`; colocated with a step budget `--itl-target-ms 40`
  (chunked prefill); disaggregated 1 + 1 (`--prefill-devices cpu:1 --decode-devices cpu:1`);
- 4 workers: colocated `cpu:4`; `cpu:4 --itl-target-ms 40`; disaggregated 1 + 3 and 2 + 2.

Every worker is `--step-ms 20 --per-seq-ms 0.05 --prefill-ms-per-token 0.1` (a 3,000-token
prefill costs 300 ms) with the hand-off's default cost (128 KiB a token over 25 GB/s: 16 ms
for 3,000 tokens). The load is one open loop (Poisson) of the lab's bench with two request
classes: `chat` (85%: 16-token prompts, 64-192 tokens each: the decoding streams) and `long`
(15%: prompts of 16-3,000 tokens, 16 tokens each). Each run gives ITL p50 / p99 (every
stream, and the chat streams'), TTFT p50 / p99 of each class, tokens/s, and the goodput
under the SLO (`--slo`, default TTFT p99 <= 1,000 ms and ITL p99 <= 60 ms: a request is good
when its own TTFT and its own ITL p99 meet them; `cadence.lab.analysis.goodput`).

The sweep runs the disaggregated 1 + 1 setup at the highest load with each
`--disaggregate-above` of `--sweep`: a prompt over it is prefilled on the prefill worker
and handed off, a shorter one runs whole on the decode worker.

With `--capacity`, each setup also gets `cadence capacity`'s search (the largest rate whose
runs meet the SLO, `cadence.lab.capacity.search`), which takes about ten runs a setup.

    flock /tmp/cadence-bench.lock python benchmarks/disaggregation.py \\
        [--duration 30] [--rates 3,6,9] [--sweep 0,64,256,512,1024,2048] [--capacity] \\
        [--out results/disaggregation.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path

import msgspec

from cadence.lab.analysis.goodput import parse_term
from cadence.lab.bench import Workload, run_bench
from cadence.lab.capacity import search
from cadence.lab.load.plan import ClassMix, RequestClass, RequestShape
from cadence.lab.results import BenchResult, Distribution, SloTerm
from cadence.lab.servers.server_process import ServerProcess

ENGINE = ("--step-ms", "20", "--per-seq-ms", "0.05", "--prefill-ms-per-token", "0.1")
SETUPS: dict[str, tuple[int, tuple[str, ...]]] = {
    "colocated 2": (2, ("--devices", "cpu:2")),
    "colocated 2 --itl-target-ms 40": (2, ("--devices", "cpu:2", "--itl-target-ms", "40")),
    "disaggregated 1+1": (2, ("--prefill-devices", "cpu:1", "--decode-devices", "cpu:1")),
    "colocated 4": (4, ("--devices", "cpu:4")),
    "colocated 4 --itl-target-ms 40": (4, ("--devices", "cpu:4", "--itl-target-ms", "40")),
    "disaggregated 1+3": (4, ("--prefill-devices", "cpu:1", "--decode-devices", "cpu:3")),
    "disaggregated 2+2": (4, ("--prefill-devices", "cpu:2", "--decode-devices", "cpu:2")),
}
"""Each setup: its workers and its flags."""
SWEEP_SETUP = "disaggregated 1+1"
CHAT = RequestClass(name="chat", prompt_tokens=(16, 16), max_tokens=(64, 192))
LONG = RequestClass(name="long", prompt_tokens=(16, 3000), max_tokens=(16, 16))
SHAPE = RequestShape(mix=ClassMix(classes=[CHAT, LONG], shares=[0.85, 0.15]))
DEFAULT_SLO = ("ttft_p99_ms=1000", "itl_p99_ms=60")


def _stats(d: Distribution | None, digits: int = 1) -> dict:
    if d is None or not d.count:
        return {}
    return {k: round(getattr(d, k), digits) for k in ("p50", "p99", "max")}


def _ratio(d: Distribution | None) -> float | None:
    if d is None or not d.count or not d.p50:
        return None
    return round(d.p99 / d.p50, 2)


def summary(result: BenchResult) -> dict:
    """What the tables read of one run."""
    classes = result.by_class or {}
    chat, long = classes.get("chat"), classes.get("long")
    goodput = result.goodput or None
    handoff = result.handoff_segments_ms or None
    return {
        "requests": result.requests,
        "requests_ok": result.requests_ok,
        "itl_ms": _stats(result.itl_ms, 2),
        "itl_p99_over_p50": _ratio(result.itl_ms),
        "ttft_ms": _stats(result.ttft_ms),
        "chat_itl_ms": _stats(chat.itl_ms if chat else None, 2),
        "chat_itl_p99_over_p50": _ratio(chat.itl_ms if chat else None),
        "chat_ttft_ms": _stats(chat.ttft_ms if chat else None),
        "long_ttft_ms": _stats(long.ttft_ms if long else None),
        "tokens_per_s": round(result.tokens_per_s, 1),
        "goodput": {
            "passed": goodput.passed,
            "requests_per_s": round(goodput.requests_per_s, 2),
            "tokens_per_s": round(goodput.tokens_per_s, 1),
            "good_share": round(goodput.good_share, 3),
            "terms": {
                k: {"bound_ms": t.bound_ms, "measured_ms": round(t.measured_ms, 1), "met": t.met}
                for k, t in goodput.terms.items()
            },
        }
        if goodput
        else None,
        "handed_off": handoff.requests if handoff else 0,
        "handoff_to_decode_p50_ms": round(handoff.to_decode.p50, 1)
        if handoff and handoff.to_decode.count
        else None,
        "offered_rate_per_s": result.client.offered_rate_per_s or None,
        "achieved_rate_per_s": result.client.achieved_rate_per_s or None,
        "errors": result.errors_by_code,
        "integrity": msgspec.to_builtins(result.integrity),
        "diagnosis": [f.rule for f in result.diagnosis],
    }


def bench(target: str, rate: float, duration: float, slo: list[SloTerm]) -> BenchResult:
    return run_bench(
        target, Workload(rate=rate, duration_s=duration, shape=SHAPE, timeout_s=120), slo=slo
    )


def run_setup(name: str, args: argparse.Namespace, slo: list[SloTerm]) -> dict:
    """Every load of `--rates` against one server of setup `name`, lowest first."""
    workers, flags = SETUPS[name]
    out: dict = {"setup": name, "workers": workers, "flags": " ".join(flags), "loads": []}
    with ServerProcess(*ENGINE, *flags) as server:
        for per_worker in args.rates:
            rate = per_worker * workers
            result = bench(server.target, rate, args.duration, slo)
            row = {"rate_per_worker": per_worker, "rate_per_s": rate, **summary(result)}
            out["loads"].append(row)
            _print(name, row)
        if args.capacity:
            out["capacity"] = _capacity(server.target, workers, args, slo)
    return out


def _capacity(target: str, workers: int, args: argparse.Namespace, slo: list[SloTerm]) -> dict:
    low, high = (r * workers for r in args.capacity_range)
    found = search(
        lambda rate: bench(target, rate, args.duration, slo), "rate", low, high, slo, confirm=1
    )
    best = max(
        (p for p in found.points if p.passed and p.value == found.max_passing),
        key=lambda p: p.goodput_tokens_per_s,
        default=None,
    )
    return {
        "max_passing_rate_per_s": found.max_passing,
        "first_failing_rate_per_s": found.first_failing,
        "range_edge": found.range_edge,
        "binding": found.binding,
        "reasons": found.reasons,
        "goodput_tokens_per_s_at_max_passing": round(best.goodput_tokens_per_s, 1)
        if best
        else None,
        "runs": found.runs,
        "elapsed_s": round(found.elapsed_s),
    }


def run_sweep(args: argparse.Namespace, slo: list[SloTerm]) -> list[dict]:
    """The sweep setup at the highest load with each --disaggregate-above of `--sweep`."""
    workers, flags = SETUPS[SWEEP_SETUP]
    rate = max(args.rates) * workers
    rows = []
    for above in args.sweep:
        with ServerProcess(*ENGINE, *flags, "--disaggregate-above", str(above)) as server:
            result = bench(server.target, rate, args.duration, slo)
        row = {"disaggregate_above": above, "rate_per_s": rate, **summary(result)}
        rows.append(row)
        _print(f"{SWEEP_SETUP} --disaggregate-above {above}", row)
    return rows


def _print(name: str, row: dict) -> None:
    g = row["goodput"] or {}
    itl, ttft = row["itl_ms"], row["long_ttft_ms"]
    print(
        f"{name:>34} @ {row['rate_per_s']:g}/s: ITL p50 {itl.get('p50', math.nan):.1f} p99 "
        f"{itl.get('p99', math.nan):.1f} ms ({row['itl_p99_over_p50']}), TTFT p99 chat "
        f"{row['chat_ttft_ms'].get('p99', math.nan):.0f} long {ttft.get('p99', math.nan):.0f} "
        f"ms, {row['tokens_per_s']:.0f} tok/s, goodput {g.get('requests_per_s', math.nan):.2f} "
        f"req/s ({g.get('good_share', math.nan):.0%} good, SLO "
        f"{'met' if g.get('passed') else 'missed'}), {row['handed_off']} handed off; "
        f"errors {row['errors'] or 'none'}; {', '.join(row['diagnosis']) or 'no finding'}",
        flush=True,
    )


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds a run")
    parser.add_argument(
        "--rates", type=_floats, default=[3.0, 6.0, 9.0], help="requests/s per worker"
    )
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated names")
    parser.add_argument(
        "--sweep",
        type=lambda t: [int(v) for v in t.split(",") if v],
        default=[0, 64, 256, 512, 1024, 2048],
        help="--disaggregate-above values for the sweep ('' for none)",
    )
    parser.add_argument("--slo", action="append", default=None, help="e.g. ttft_p99_ms=1000")
    parser.add_argument("--capacity", action="store_true", help="also cadence capacity's search")
    parser.add_argument(
        "--capacity-range",
        type=_floats,
        default=[1.0, 16.0],
        help="LOW,HIGH requests/s per worker",
    )
    parser.add_argument("--out", default="results/disaggregation.json")
    args = parser.parse_args()
    slo = [parse_term(t) for t in args.slo or DEFAULT_SLO]
    started = time.monotonic()
    setups = [run_setup(name, args, slo) for name in args.setups.split(",") if name]
    sweep = run_sweep(args, slo) if args.sweep else []
    command = (
        f"python benchmarks/disaggregation.py --duration {args.duration:g} --rates "
        f"{','.join(f'{r:g}' for r in args.rates)} --sweep {','.join(map(str, args.sweep))}"
        + (" --capacity" if args.capacity else "")
    )
    out = {
        "what": "open loop (Poisson) of two request classes: chat (85%, 16-token prompts, "
        "64-192 tokens each) and long (15%, prompts of 16-3000 tokens, 16 tokens each), at "
        f"{', '.join(f'{r:g}' for r in args.rates)} requests/s per worker, {args.duration:g} s "
        "a run, synthetic workers",
        "engine": "cadence serve " + " ".join(ENGINE),
        "slo": [f"{t.metric}_{t.stat}_ms<={t.bound_ms:g}" for t in slo],
        "command": command,
        "host": {
            "cores": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "note": "a 2-core host shared with other work: clients, front and workers on it",
        },
        "date": datetime.date.today().isoformat(),
        "wall_s": round(time.monotonic() - started),
        "setups": setups,
        "sweep_setup": SWEEP_SETUP,
        "sweep": sweep,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({out['wall_s']} s)")


if __name__ == "__main__":
    main()

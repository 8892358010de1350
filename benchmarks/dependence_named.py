"""How often the lab names what the latency depends on (issue 51): each planted cause of
tests/dependence_shapes.py run N times (its parameter sets and both fronts, gRPC and OpenAI
SSE, in turn, a new seed each run), the clean servers M times, every run through `run_bench`
as a user would drive a server cadence did not write.

A planted run counts as named when the cause's rule (`itl_depends_on`, `ttft_depends_on`)
fired and its strongest finding names one of the cause's variables, with one of its shapes,
a size in ms (for a period, the planted K) and a quarter of its tail or more; as misnamed when a taught signature the cause
contradicts fired (`gaps_at_fixed_values` on a per-block wait). A clean run stays clean when
neither dependence rule fired. Runs where the lab found the host contended (other jobs on its
cores) are counted and kept: the figure is what the lab did on the host it had.

    python benchmarks/dependence_named.py [--runs 10] [--clean-runs 20] [--shapes block leak]
        [--out results/dependence_named.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cadence.lab.analysis.diagnosis.names import (
    RULE_HOST_CONTENDED,
    RULE_ITL_DEPENDS_ON,
    RULE_TTFT_DEPENDS_ON,
)
from cadence.lab.results import BenchResult, to_builtins
from tests.dependence_shapes import CLEAN, PLANTED, Planted, on_fronts, planted_period
from tests.integration.test_engine_shaped_diagnosis import Case, bench

SHARE_MIN = 0.25
KEEP: Path | None = None
"""`--keep DIR`: every run's result is written there (diagnosed again offline with
`msgspec.convert(json.load(f), BenchResult)`)."""


def _kept(name: str, case: Case, result: BenchResult) -> None:
    if KEEP is not None:
        KEEP.mkdir(parents=True, exist_ok=True)
        path = KEEP / f"{name}-{case.front}-{case.seed}.json"
        path.write_text(json.dumps(to_builtins(result)))


def _row(case: Case, result: BenchResult, seconds: float) -> dict:
    rules = sorted({f.rule for f in result.diagnosis})
    return {
        "front": case.front,
        "server": " ".join(case.server),
        "seed": case.seed,
        "seconds": round(seconds, 1),
        "rules": rules,
        "contended": RULE_HOST_CONTENDED in rules,
        "verdict": result.verdict.state,
    }


def planted_run(name: str, planted: Planted, case: Case) -> dict:
    started = time.monotonic()
    result = bench(case)
    _kept(name, case, result)
    row = _row(case, result, time.monotonic() - started)
    found = [f for f in result.diagnosis if f.rule == planted.rule]
    key = "itl_tail_share" if planted.rule == RULE_ITL_DEPENDS_ON else "ttft_tail_share"
    top = found[0].evidence if found else {}
    row.update(
        {
            "variable": top.get("variable"),
            "shape": top.get("shape"),
            "size": top.get("size"),
            "tail_share": top.get(key),
            "finding": found[0].finding if found else None,
        }
    )
    row["period"] = top.get("period")
    row["named"] = bool(
        found
        and top["variable"] in planted.variables
        and top["shape"] in planted.shapes
        and "ms" in str(top.get("size"))
        and float(top.get(key) or 0) >= SHARE_MIN
        and (top["shape"] != "periodic" or top.get("period") == planted_period(case))
    )
    row["misnamed_by"] = sorted(planted.misnamed_by & set(row["rules"]))
    return row


def clean_run(case: Case) -> dict:
    started = time.monotonic()
    result = bench(case)
    _kept("clean", case, result)
    row = _row(case, result, time.monotonic() - started)
    named = [f for f in result.diagnosis if f.rule in (RULE_ITL_DEPENDS_ON, RULE_TTFT_DEPENDS_ON)]
    row["clean"] = not named
    row["named"] = [f.finding for f in named]
    return row


def _tally(rows: list[dict], key: str) -> dict:
    return {
        "runs": len(rows),
        key: sum(1 for r in rows if r[key]),
        "contended_runs": sum(1 for r in rows if r["contended"]),
        f"{key}_uncontended": sum(1 for r in rows if r[key] and not r["contended"]),
        "uncontended_runs": sum(1 for r in rows if not r["contended"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs of each planted cause")
    p.add_argument("--clean-runs", type=int, default=20)
    p.add_argument("--shapes", nargs="*", default=list(PLANTED), choices=list(PLANTED))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "dependence_named.json")
    p.add_argument("--keep", type=Path, help="write every run's result JSON in this folder")
    args = p.parse_args()
    global KEEP
    KEEP = args.keep

    started = time.monotonic()
    out: dict = {
        "command": "python " + " ".join(sys.argv),
        "date": date.today().isoformat(),
        "host": f"{platform.node()} {os.cpu_count()} cores ({platform.machine()}), shared",
        "load_at_start": os.getloadavg(),
        "shapes": {},
    }
    for name in args.shapes:
        planted = PLANTED[name]
        cases = on_fronts(planted.cases)
        rows = []
        for i in range(args.runs):
            row = planted_run(name, planted, replace(cases[i % len(cases)], seed=i))
            rows.append(row)
            print(
                f"{name} {i}: {'named' if row['named'] else 'NOT named'} {row['variable']} "
                f"{row['shape']} {row['tail_share']} {row['front']}"
                f"{' contended' if row['contended'] else ''}"
                f"{' misnamed by ' + ','.join(row['misnamed_by']) if row['misnamed_by'] else ''}",
                flush=True,
            )
        out["shapes"][name] = {
            **_tally(rows, "named"),
            "misnamed": sum(1 for r in rows if r["misnamed_by"]),
            "variables": sorted(planted.variables),
            "shapes": sorted(planted.shapes),
            "rows": rows,
        }
    cases = on_fronts(CLEAN)
    rows = []
    for i in range(args.clean_runs):
        row = clean_run(replace(cases[i % len(cases)], seed=i))
        rows.append(row)
        print(
            f"clean {i}: {'clean' if row['clean'] else 'NAMED ' + '; '.join(row['named'])} "
            f"{row['front']}{' contended' if row['contended'] else ''}",
            flush=True,
        )
    out["clean"] = {**_tally(rows, "clean"), "rows": rows} if rows else {}
    out["load_at_end"] = os.getloadavg()
    out["wall_s"] = round(time.monotonic() - started, 1)
    print(
        json.dumps(
            {
                **{k: {x: v[x] for x in v if x != "rows"} for k, v in out["shapes"].items()},
                "clean": {x: v for x, v in out["clean"].items() if x != "rows"},
                "wall_s": out["wall_s"],
            },
            indent=1,
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The README's "One figure" as a picture: each ABBA pair of `serving_overhead.py --burst`,
cadence against the bare grpc.aio server streaming the same from memory: TTFT p99, and the
front's CPU per streamed chunk.

    python benchmarks/plot_serving_overhead.py [results/serving_overhead_w1_burst.json] \
        [--out docs/img/serving_overhead_burst.png]

Needs matplotlib (`pip install 'cadence[lab]'`). It reads the result file only: no run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "results" / "serving_overhead_w1_burst.json"
OUT = ROOT / "docs" / "img" / "serving_overhead_burst.png"
SIDES = (("cadence", "cadence", "#1f77b4"), ("reference", "bare grpc.aio", "#bbbbbb"))


def front_cpu_per_chunk_us(side: dict) -> float:
    return side["server_cpu_s"]["front"] / side["chunks"] * 1e6


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = result["pairs"]
    x = range(1, len(pairs) + 1)
    width = 0.38
    fig, (ttft, cpu) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for k, (key, label, colour) in enumerate(SIDES):
        at = [i + (k - 0.5) * width for i in x]
        ttft.bar(at, [p[key]["ttft_ms"]["p99"] for p in pairs], width, label=label, color=colour)
        cpu.bar(
            at, [front_cpu_per_chunk_us(p[key]) for p in pairs], width, label=label, color=colour
        )
    for i, p in zip(x, pairs, strict=True):
        ratio = front_cpu_per_chunk_us(p["cadence"]) / front_cpu_per_chunk_us(p["reference"])
        top = max(front_cpu_per_chunk_us(p[key]) for key, _, _ in SIDES)
        cpu.annotate(
            f"{ratio:.2f}x",
            (i, top),
            ha="center",
            va="bottom",
            fontsize=9,
            xytext=(0, 2),
            textcoords="offset points",
        )
    cpu.set_ylim(
        top=1.15 * max(front_cpu_per_chunk_us(p[key]) for p in pairs for key, _, _ in SIDES)
    )
    labels = [
        f"{i}\n({'AB' if p['order'][0] == 'cadence' else 'BA'})"
        for i, p in zip(x, pairs, strict=True)
    ]
    ttft.set(title="TTFT p99 (lower is better)", ylabel="ms", xlabel="pair (run order)")
    cpu.set(
        title="front CPU per chunk (above: cadence / bare)", ylabel="µs", xlabel="pair (run order)"
    )
    for ax in (ttft, cpu):
        ax.set_xticks(list(x), labels)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    ttft.legend(loc="upper right")
    cadence = pairs[0]["cadence"]
    fig.suptitle(
        f"{cadence['requests']} streams x {cadence['output_tokens'] // cadence['requests']} tokens "
        f"opened at once, one token every 20 ms each, {result['machine']['cpus']} CPU cores "
        f"({result['started'][:10]})",
        fontsize=11,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", nargs="?", type=Path, default=RESULT)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    plot(json.loads(args.result.read_text()), args.out)
    print(args.out)


if __name__ == "__main__":
    main()

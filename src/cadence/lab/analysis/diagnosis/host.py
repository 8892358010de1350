"""Rules on the host's CPU and cards: `front_cpu_bound` (a front near a full core) and
`cpu_busy_cards_idle` (a process near a full core while every card is mostly idle)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.facts import RunFacts, finite, rounded
from cadence.lab.analysis.diagnosis.names import RULE_CPU_BUSY_CARDS_IDLE, RULE_FRONT_CPU_BOUND
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.results import Finding

BUSY_CPU_PCT = 80.0
"""A process is near one core from this % of a core, averaged over the run. The front's
event loop runs on one thread; above 80 % its queue builds up."""

IDLE_CARD_PCT = 30.0
"""A card is mostly idle below this utilisation, averaged over the run."""


def _fronts(facts: RunFacts) -> list[str]:
    """The sampled front processes: "front" (one front), or "front0", "front1", ... with
    `--fronts N`, in front order."""
    names = [
        n
        for n in facts.result.system.processes
        if n == "front" or (n.startswith("front") and n[5:].isdigit())
    ]
    return sorted(names, key=lambda n: int(n[5:] or 0))


def front_cpu_bound(facts: RunFacts) -> list[Finding]:
    # Each front's event loop is one thread: with `--fronts N` any one of them near a core
    # is a bottleneck for its own connections, however idle the others are.
    cpu = {name: pct for name in _fronts(facts) if (pct := facts.active_cpu(name)) is not None}
    busy = [name for name, pct in cpu.items() if pct >= BUSY_CPU_PCT]
    if not busy:
        return []
    evidence: dict = {f"{name}_cpu_pct": rounded(pct, 1) for name, pct in cpu.items()}
    if finite(facts.result.chunks_per_s):
        evidence["chunks_per_s"] = rounded(facts.result.chunks_per_s, 0)
    look_at = (
        "more front processes, fewer chunks (let tokens merge, larger steps), less "
        "work per chunk in the front (timing, text decoding)"
    )
    if list(cpu) == ["front"]:
        finding = (
            f"the front used {cpu['front']:.0f}% of a core during the run: it is the bottleneck"
        )
    else:
        pct = max(cpu[name] for name in busy)
        finding = (
            f"{' and '.join(busy)} of {len(cpu)} fronts used up to {pct:.0f}% of a core "
            "during the run: a busy front is the bottleneck for its connections"
        )
        if len(busy) < len(cpu):
            look_at += (
                "; the kernel spreads connections, not streams, over the fronts: more "
                "client connections (--channels, --procs) even them out"
            )
    return [Finding(rule=RULE_FRONT_CPU_BOUND, finding=finding, evidence=evidence, look_at=look_at)]


def cpu_busy_cards_idle(facts: RunFacts) -> list[Finding]:
    system = facts.result.system
    utils = [g.util_pct_mean or 0.0 for g in system.gpus]
    if not utils or max(utils) >= IDLE_CARD_PCT:
        return []
    busy = [n for n, p in system.processes.items() if (p.cpu_pct_mean or 0) >= BUSY_CPU_PCT]
    if not busy:
        return []
    gpus = {
        f"gpu{g.index}_util_pct": rounded(g.util_pct_mean, 1)
        for g in system.gpus
        if finite(g.util_pct_mean)
    }
    cpu = {
        f"{name}_cpu_pct_mean": rounded(p.cpu_pct_mean, 1)
        for name, p in system.processes.items()
        if finite(p.cpu_pct_mean)
    }
    return [
        Finding(
            rule=RULE_CPU_BUSY_CARDS_IDLE,
            finding=(
                f"CPU busy while the cards idle: {', '.join(busy)} at >= {BUSY_CPU_PCT:.0f}% "
                f"of a core, cards at most {max(utils):.0f}% utilised"
            ),
            evidence={**cpu, **gpus},
            look_at=(
                "host-side work that keeps the cards waiting: data movement, collective "
                "communication on CPU, Python between steps, the front"
            ),
        )
    ]


RULES = (
    Rule(RULE_FRONT_CPU_BOUND, front_cpu_bound),
    Rule(RULE_CPU_BUSY_CARDS_IDLE, cpu_busy_cards_idle),
)

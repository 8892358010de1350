"""Rules on the host's CPU and cards: `front_cpu_bound` (a front near a full core),
`cpu_busy_cards_idle` (a process near a full core while every card is mostly idle) and
`host_contended` (other work on the host took the CPUs the server and the lab needed)."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.facts import RunFacts, finite, rounded
from cadence.lab.analysis.diagnosis.names import (
    RULE_CPU_BUSY_CARDS_IDLE,
    RULE_FRONT_CPU_BOUND,
    RULE_HOST_CONTENDED,
)
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.results import Finding

BUSY_CPU_PCT = 80.0
"""A process is near one core from this % of a core, averaged over the run. The front's
event loop runs on one thread; above 80 % its queue builds up."""

IDLE_CARD_PCT = 30.0
"""A card is mostly idle below this utilisation, averaged over the run."""

OTHERS_MIN_PCT = 50.0
"""Other work contends for the host when processes outside the server and the lab used this
% of a core or more while the run was going..."""
HOST_FULL_SPARE_CORES = 0.5
"""...and the host had less than this many cores to spare (busy above its cores minus this):
on a host with cores to spare, other work costs the server nothing."""


def _fronts(facts: RunFacts) -> list[str]:
    """The sampled front processes: "front" (one front), or "front0", "front1", ... with
    `--fronts N`, in front order."""
    names = [n for n in facts.result.system.processes
             if n == "front" or (n.startswith("front") and n[5:].isdigit())]
    return sorted(names, key=lambda n: int(n[5:] or 0))


def front_cpu_bound(facts: RunFacts) -> list[Finding]:
    # Each front's event loop is one thread: with `--fronts N` any one of them near a core
    # is a bottleneck for its own connections, however idle the others are.
    cpu = {name: facts.active_cpu(name) for name in _fronts(facts)}
    cpu = {name: pct for name, pct in cpu.items() if pct is not None}
    busy = [name for name, pct in cpu.items() if pct >= BUSY_CPU_PCT]
    if not busy:
        return []
    evidence: dict = {f"{name}_cpu_pct": rounded(pct, 1) for name, pct in cpu.items()}
    if finite(facts.result.chunks_per_s):
        evidence["chunks_per_s"] = rounded(facts.result.chunks_per_s, 0)
    look_at = ("more front processes, fewer chunks (let tokens merge, larger steps), less "
               "work per chunk in the front (timing, text decoding)")
    if list(cpu) == ["front"]:
        finding = (f"the front used {cpu['front']:.0f}% of a core during the run: it is the "
                   "bottleneck")
    else:
        pct = max(cpu[name] for name in busy)
        finding = (f"{' and '.join(busy)} of {len(cpu)} fronts used up to {pct:.0f}% of a core "
                   "during the run: a busy front is the bottleneck for its connections")
        if len(busy) < len(cpu):
            look_at += ("; the kernel spreads connections, not streams, over the fronts: more "
                        "client connections (--channels, --procs) even them out")
    return [Finding(rule=RULE_FRONT_CPU_BOUND, finding=finding, evidence=evidence,
                    look_at=look_at)]


def cpu_busy_cards_idle(facts: RunFacts) -> list[Finding]:
    system = facts.result.system
    utils = [g.util_pct_mean or 0.0 for g in system.gpus]
    if not utils or max(utils) >= IDLE_CARD_PCT:
        return []
    busy = [n for n, p in system.processes.items() if (p.cpu_pct_mean or 0) >= BUSY_CPU_PCT]
    if not busy:
        return []
    gpus = {f"gpu{g.index}_util_pct": rounded(g.util_pct_mean, 1)
            for g in system.gpus if finite(g.util_pct_mean)}
    cpu = {f"{name}_cpu_pct_mean": rounded(p.cpu_pct_mean, 1)
           for name, p in system.processes.items() if finite(p.cpu_pct_mean)}
    return [Finding(
        rule=RULE_CPU_BUSY_CARDS_IDLE,
        finding=(f"CPU busy while the cards idle: {', '.join(busy)} at >= {BUSY_CPU_PCT:.0f}% "
                 f"of a core, cards at most {max(utils):.0f}% utilised"),
        evidence={**cpu, **gpus},
        look_at=("host-side work that keeps the cards waiting: data movement, collective "
                 "communication on CPU, Python between steps, the front"),
    )]


def host_contended(facts: RunFacts) -> list[Finding]:
    # Busy minus ours: the others' share holds processes that came and went during the run
    # (a build's compilers), which no per-process reading alone would catch.
    host = facts.result.system.host or None
    if host is None:
        return []
    busy = facts.active_mean([(t, pct) for t, pct, _ in host.samples])
    lab = facts.active_mean([(t, pct) for t, _, pct in host.samples])
    if busy is None or lab is None or busy < 100 * (host.cpus - HOST_FULL_SPARE_CORES):
        return []
    clients = [n for n in facts.result.system.processes if n.startswith("client")]
    client = sum(facts.active_cpu(n) or 0.0 for n in clients)
    sampled = sum(facts.active_cpu(n) or 0.0 for n in facts.result.system.processes
                  if n not in clients)
    threads = facts.result.server_threads or None
    # The server's thread reading holds its children too (a foreign server's engine processes).
    server = max(sampled, sum(p.cpu_pct for p in threads.processes) if threads else 0.0)
    others = busy - server - client - lab
    if others < OTHERS_MIN_PCT:
        return []
    evidence: dict = {"host_cpus": host.cpus, "host_busy_cores": rounded(busy / 100),
                      "others_cores": rounded(others / 100), "server_cores": rounded(server / 100),
                      "client_cores": rounded(client / 100), "lab_cores": rounded(lab / 100)}
    if threads:
        evidence["server_waited_for_cpu_cores"] = rounded(
            sum(g.wait_for_cpu_pct for g in threads.groups) / 100)
    named = ", ".join(f"{o.name} (pid {o.pid}) {o.cpu_pct:.0f}%" for o in host.others)
    if named:
        evidence["other_processes"] = named
    return [Finding(
        rule=RULE_HOST_CONTENDED,
        finding=(f"other work on this host used {others / 100:.1f} of its {host.cpus} cores "
                 f"during the run{f' ({named})' if named else ''}, and the host had no core to "
                 "spare: the server's and the client's threads waited for CPUs, so this run's "
                 "tails are partly the host's"),
        evidence=evidence,
        look_at=("measure on a quiet host, or give the server and the load cores no other job "
                 "uses (taskset, cgroup cpusets); top or pidstat names the other work"),
    )]


RULES = (
    Rule(RULE_FRONT_CPU_BOUND, front_cpu_bound),
    Rule(RULE_CPU_BUSY_CARDS_IDLE, cpu_busy_cards_idle),
    Rule(RULE_HOST_CONTENDED, host_contended),
)

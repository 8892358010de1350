"""Rules on the server's own threads (read from /proc on this host, any language):
`server_one_core_bound` (a server process held to about one core, by one busy thread or by a
lock such as Python's GIL, while the host has cores to spare) and
`server_threads_wait_for_cpu` (the server's threads were ready to run but waited for a CPU:
more runnable threads than cores, or a host with no core to spare whose waits made a bad
tail).

Whose core it is decides what the finding is. A front's event loop or a foreign server's one
serving thread at a full core sets the pace of every stream it serves: an alarm. A cadence
worker whose engine steps on the CPU fills its core by design (it steps without pause while
it has sequences): its step is the bound of its streams, which is the engine's nature and
not a fault of the serving, so the finding is information. A worker that drives a card and
fills a core is an alarm again: the host side of its step holds the card."""

from __future__ import annotations

import re

from cadence.lab.analysis.diagnosis.coincidence import bad_tails, judged_tails
from cadence.lab.analysis.diagnosis.facts import Contention, RunFacts, rounded
from cadence.lab.analysis.diagnosis.host import BUSY_CPU_PCT
from cadence.lab.analysis.diagnosis.names import (
    RULE_FRONT_CPU_BOUND,
    RULE_HOST_CONTENDED,
    RULE_SERVER_ONE_CORE_BOUND,
    RULE_SERVER_THREADS_WAIT_FOR_CPU,
)
from cadence.lab.analysis.diagnosis.rule import GiveWay, Rule
from cadence.lab.results import ALARM, INFORMATION, Finding, ServerProcessThreads

ONE_CORE_CEILING_PCT = 115.0
"""A process above this much of one core runs on several at once: not held to one."""

SPARE_CORES = 0.5
"""The host has cores to spare when the server's processes together use less than its cores
minus this."""

WAIT_CORES = 1.0
"""The server's threads waited for a CPU this many cores' worth of the run (on average one
thread always ready but not running): the host has too few cores for its runnable threads."""
WAIT_SHARE = 0.5
"""...and waiting made at least this share of their time on or ready for a CPU."""

FULL_HOST_WAIT_CORES = 0.25
"""On a host with no core to spare (`RunFacts.host_full`, whoever filled it), the server's
threads that waited for a CPU this many cores' worth of the run or more bear on a bad tail.
A thread ready to run on a full host waits for the one running to use up its scheduler slice,
longer than a fast engine's step or a token's send: a step the wait falls into comes out
several times its median, and a handful of them make the p99. A quarter of a core's worth
is one of the server's busy threads kept off a CPU a quarter of the run, on every few of its
steps rather than at the odd wake-up (which the run's noise floor, its wake-up probe, holds
already), and stays below what a server whose threads fit the cores waits on the same full
host, so the waits alone, without a bad tail, are no finding."""


ENGINE_STEP_LOOK_AT = (
    "the engine's step, not the serving layer: a faster step (a smaller or quantised model, a "
    "compiled or fused step, the engine's CPU threads: torch.set_num_threads, OMP_NUM_THREADS), "
    "or more workers or devices (--devices cpu:N, more cards) so that more batches step side "
    "by side; py-spy dump --pid {pid} shows where the step goes"
)


_DEVICE = re.compile(r'"device"\s*:\s*"([^"]*)"')
"""A cadence worker's device in its command line (the JSON spec it starts with)."""
_INDEX = re.compile(r'"index"\s*:\s*(\d+)')
"""...and its index."""


def _worker_index(role: str) -> int | None:
    """A cadence worker's index from its role ("worker3" → 3); None for any other role, or
    a worker whose index is not known."""
    index = role.removeprefix("worker")
    return int(index) if role.startswith("worker") and index.isdigit() else None


def _worker_words(role: str) -> str:
    """A worker's role as a finding says it: "worker 3" ("worker" with no index)."""
    index = _worker_index(role)
    return "worker" if index is None else f"worker {index}"


def _worker_device(facts: RunFacts, role: str, command: str) -> str:
    """The device a cadence worker steps on ("cpu", "cpu:0", "cuda:1", ...; "" when not
    known): from the server's timing (`BenchResult.workers`), else from the spec on its
    command line."""
    index = _worker_index(role)
    for curve in facts.result.workers or ():
        if index is not None and curve.worker == index and curve.device:
            return curve.device
    found = _DEVICE.search(command)
    return found.group(1) if found else ""


def _role(facts: RunFacts, pid: int, command: str) -> str:
    """What the process is, from its command line: "workerN" (a cadence worker, running the
    engine's step; "worker" when its index is not known), "front" (a cadence front, its event
    loop), or "" (a server cadence did not write: the lab names any server's listener "front"
    and its children "workerN", so the name alone does not tell)."""
    named = next((name for name, p in facts.result.system.processes.items() if p.pid == pid), "")
    if "cadence.worker" in command:
        if named.startswith("worker"):
            return named
        # A front the lab named "server" (an HTTP front) leaves its workers unnamed.
        index = _INDEX.search(command)
        return f"worker{index.group(1)}" if index else "worker"
    if re.search(r"cadence(\.cli)?\s+serve\b", command):
        return "front"
    return ""


def server_one_core_bound(facts: RunFacts) -> list[Finding]:
    threads = facts.result.server_threads or None
    if threads is None or threads.cpus < 2:
        return []  # a one-core host: every process is held to one core
    if sum(p.cpu_pct for p in threads.processes) > 100 * (threads.cpus - SPARE_CORES):
        return []  # the server fills the host: no core to spare, so none holds it to one
    findings = []
    for process in threads.processes:
        # What the busiest thread asked for: its CPU and its wait for one (on a shared host a
        # thread that would fill a core gets less of it).
        demand = process.busiest_thread_cpu_pct + process.busiest_thread_wait_pct
        one_thread = demand >= BUSY_CPU_PCT and process.cpu_pct <= ONE_CORE_CEILING_PCT
        if not (one_thread or BUSY_CPU_PCT <= process.cpu_pct <= ONE_CORE_CEILING_PCT):
            continue
        if not (one_thread or process.python):
            continue  # a native process spread over threads at one core is not held to it
        evidence: dict = {
            "pid": process.pid,
            "process_cpu_pct": rounded(process.cpu_pct, 1),
            "busiest_thread": process.busiest_thread,
            "busiest_thread_cpu_pct": rounded(process.busiest_thread_cpu_pct, 1),
            "busiest_thread_wait_for_cpu_pct": rounded(process.busiest_thread_wait_pct, 1),
            "threads": process.threads,
            "host_cpus": threads.cpus,
        }
        role = _role(facts, process.pid, process.command)
        severity = ALARM
        if role.startswith("worker"):
            evidence["process"] = role
            worker = _worker_words(role)
            device = _worker_device(facts, role, process.command)
            if device:
                evidence["device"] = device
            on_cpu = device.split(":")[0] == "cpu"
            finding = (
                f"{worker} (pid {process.pid}), the process that runs the engine's "
                f"step{' on the CPU' if on_cpu else ''}, used {process.cpu_pct:.0f}% of a "
                f"core (its busiest thread {process.busiest_thread_cpu_pct:.0f}%, waiting "
                f"{process.busiest_thread_wait_pct:.0f}% more for one) while the "
                f"host has {threads.cpus}: the engine's step is the bound of every "
                "stream this worker serves"
            )
            if on_cpu:
                # A CPU engine's worker steps without pause while it has sequences: a full
                # core is its nature, not a fault of the serving.
                severity = INFORMATION
                finding += " (a CPU engine's worker fills its core by design: information)"
            look_at = ENGINE_STEP_LOOK_AT.format(pid=process.pid)
        elif role.startswith("front"):
            evidence["process"] = role
            finding = (
                f"the front's event loop (pid {process.pid}, "
                f"'{process.busiest_thread}') ran at "
                f"{process.busiest_thread_cpu_pct:.0f}% of a core (and waited "
                f"{process.busiest_thread_wait_pct:.0f}% more for one) while the "
                f"host has {threads.cpus}: that loop sets the pace of every stream "
                "the front serves"
            )
            look_at = (
                "what runs on the front's loop: py-spy dump --pid "
                f"{process.pid}; user code in the front (--app-in-front) moves to the "
                "workers; --fronts N runs several fronts behind the port, each with "
                "its own loop"
            )
        elif one_thread:
            finding = (
                f"one thread of the server (pid {process.pid}, '{process.busiest_thread}')"
                f" ran at {process.busiest_thread_cpu_pct:.0f}% of a core (and waited "
                f"{process.busiest_thread_wait_pct:.0f}% more for one) while the "
                f"host has {threads.cpus}: that thread (an event loop, a single "
                "dispatcher) sets the pace of every stream it serves"
            )
            look_at = (
                "what runs on that thread: profile it (py-spy dump for Python); move "
                "per-token work off the event loop, or run more processes behind the "
                "port (SO_REUSEPORT) so each has its own loop"
            )
        else:
            finding = (
                f"the server's Python process (pid {process.pid}) used "
                f"{process.cpu_pct:.0f}% of a core spread over {process.threads} "
                f"threads, none above {process.busiest_thread_cpu_pct:.0f}%, while the "
                f"host has {threads.cpus}: its threads take turns on the GIL"
            )
            look_at = (
                "Python threads run one at a time: more threads in the pool add "
                "switching, not speed; serve from more processes, or move the "
                "per-token work into code that releases the GIL"
            )
        findings.append(
            Finding(
                rule=RULE_SERVER_ONE_CORE_BOUND,
                finding=finding,
                evidence=evidence,
                look_at=look_at,
                severity=severity,
            )
        )
    return findings


def server_threads_wait_for_cpu(facts: RunFacts) -> list[Finding]:
    threads = facts.result.server_threads or None
    if threads is None:
        return []
    waited = sum(g.wait_for_cpu_pct for g in threads.groups) / 100
    ran = sum(g.cpu_pct for g in threads.groups) / 100
    if waited < WAIT_CORES or waited / (waited + ran) < WAIT_SHARE or waited + ran < threads.cpus:
        # ...and the server itself wants more cores than the host has; else a host whoever
        # filled, whose waits made a tail bad.
        return _full_host_waits(facts, waited, ran)
    worst = sorted(threads.groups, key=lambda g: g.wait_for_cpu_pct, reverse=True)[:3]
    evidence: dict = {
        "waited_cores": rounded(waited),
        "ran_cores": rounded(ran),
        "host_cpus": threads.cpus,
        "server_threads": threads.threads,
    }
    for g in worst:
        evidence[f"{g.name}_wait_pct"] = rounded(g.wait_for_cpu_pct, 1)
        evidence[f"{g.name}_involuntary_switches_per_s"] = rounded(g.involuntary_switches_per_s, 0)
    # The waits cost the streams something only where a judged tail went over its bound; a
    # run whose tails held is told of them, with no alarm (a healthy server's waits are no
    # fault to chase).
    judged = judged_tails(facts)
    held = bool(judged) and all(t.state == "healthy" for t in judged)
    return [
        Finding(
            rule=RULE_SERVER_THREADS_WAIT_FOR_CPU,
            finding=(
                f"the server's threads waited for a CPU {waited:.1f} cores' worth of the run "
                f"while running {ran:.1f}: more threads were ready than the host's "
                f"{threads.cpus} cores could run, so each waits its turn (most: "
                f"{', '.join(g.name for g in worst)})"
                + ("; every tail judged stayed within its bound (information)" if held else "")
            ),
            evidence=evidence,
            look_at=(
                "fewer runnable threads than cores: size thread pools (and OMP/MKL threads) "
                "to the cores left to the server, keep the load generator off the server's "
                "cores, or give the server more cores"
            ),
            severity=INFORMATION if held else ALARM,
        )
    ]


def _named(facts: RunFacts, process: ServerProcessThreads) -> str:
    """The process as a finding names it: "worker 0", "the front", or "pid N"."""
    role = _role(facts, process.pid, process.command)
    if role.startswith("worker"):
        return _worker_words(role)
    return "the front" if role == "front" else f"pid {process.pid}"


def step_thread_waits_ms(facts: RunFacts) -> dict[int, float]:
    """How long each cadence worker's busiest thread (its step's, for an engine stepping on
    the CPU) waited for a CPU over the run, by worker index (ms); {} without the server's
    threads."""
    threads = facts.result.server_threads or None
    if threads is None or not threads.wall_s:
        return {}
    waits = {}
    for process in threads.processes:
        index = _worker_index(_role(facts, process.pid, process.command))
        if index is not None:
            waits[index] = process.busiest_thread_wait_pct / 100 * threads.wall_s * 1e3
    return waits


def _full_host_waits(facts: RunFacts, waited: float, ran: float) -> list[Finding]:
    """The host had no core to spare, the server's threads waited for a CPU
    FULL_HOST_WAIT_CORES or more, and a tail the verdict judges is bad: the waits bear on it,
    whoever filled the cores (the server's own threads, the load's client, other work)."""
    threads = facts.result.server_threads
    full = facts.host_full
    if not threads or full is None or waited < FULL_HOST_WAIT_CORES:
        return []
    bad = bad_tails(facts)
    if not bad:
        return []
    waiting = sorted(threads.processes, key=lambda p: p.busiest_thread_wait_pct, reverse=True)
    waiting = [p for p in waiting if p.busiest_thread_wait_pct > 0][:3]
    evidence: dict = {
        "host_cpus": full.cpus,
        "host_busy_cores": rounded(full.busy / 100),
        "server_cores": rounded(full.server / 100),
        "client_cores": rounded(full.client / 100),
        "others_cores": rounded(max(0.0, full.others) / 100),
        "lab_cores": rounded(full.lab / 100),
        "waited_cores": rounded(waited),
        "ran_cores": rounded(ran),
        "server_threads": threads.threads,
        "bad_tails": ",".join(bad),  # evidence holds scalars: "itl_ms,ttft_ms"
    }
    for p in waiting:
        key = _role(facts, p.pid, p.command) or f"pid{p.pid}"
        evidence[f"{key}_busiest_thread_wait_pct"] = rounded(p.busiest_thread_wait_pct, 1)
        evidence[f"{key}_busiest_thread_cpu_pct"] = rounded(p.busiest_thread_cpu_pct, 1)
    who = "; ".join(
        f"{_named(facts, p)}'s busiest thread (pid {p.pid}) waited "
        f"{p.busiest_thread_wait_pct:.0f}% of the run on top of running "
        f"{p.busiest_thread_cpu_pct:.0f}%"
        for p in waiting
    )
    words = " and ".join({"itl_ms": "ITL", "ttft_ms": "TTFT"}[m] for m in bad)
    return [
        Finding(
            rule=RULE_SERVER_THREADS_WAIT_FOR_CPU,
            finding=(
                f"the host had no core to spare ({_filled_by(full)}) and the server's threads "
                f"waited for a CPU {waited:.2f} cores' worth of the run while running "
                f"{ran:.2f}{f' ({who})' if who else ''}: a thread kept off a CPU for a "
                "scheduler slice makes a slow step or a late send, so the "
                f"{words} tail{'s are' if len(bad) > 1 else ' is'} the full host's, not the "
                "server's code"
            ),
            evidence=evidence,
            look_at=_full_host_look_at(facts),
        )
    ]


def _filled_by(full: Contention) -> str:
    """Who used the host's cores, in words."""
    parts = [
        f"the server's threads {full.server / 100:.2f} cores",
        f"the load's client {full.client / 100:.2f}",
    ]
    if full.others >= 5.0:  # below a twentieth of a core: the samplers' disagreement
        parts.append(f"other work {full.others / 100:.2f}")
    return f"{full.busy / 100:.2f} of its {full.cpus} cores busy: " + ", ".join(parts)


def _full_host_look_at(facts: RunFacts) -> str:
    threads = facts.result.server_threads or None
    cadence = threads is not None and any(_role(facts, p.pid, p.command) for p in threads.processes)
    fewer = (
        "fewer busy threads than cores: the engine's CPU threads (torch.set_num_threads, "
        "OMP_NUM_THREADS) and fewer workers (--devices cpu:N)"
        if cadence
        else "fewer busy threads than cores: the server's workers and its engine's CPU "
        "threads (OMP_NUM_THREADS, thread pools)"
    )
    return (
        f"{fewer}, so the server's threads fit the cores the load leaves them; the load on "
        "other cores (taskset -c for the server and for cadence bench) or on another host; "
        "or a host with more cores"
    )


def _starved(finding: Finding, facts: RunFacts) -> bool:
    """The busiest thread waited for a CPU longer than it ran. On a host other work filled
    (`host_contended`) its waits are that work's doing: a thread that wakes for a little
    work per token waits for a CPU at every wake-up, so running plus waiting reaches a core
    with no load of its own to fill one. The lab then cannot tell it from a thread that
    would fill a core; the cause it can see is the host's."""
    ran = finding.evidence.get("busiest_thread_cpu_pct")
    waited = finding.evidence.get("busiest_thread_wait_for_cpu_pct")
    return isinstance(ran, int | float) and isinstance(waited, int | float) and waited > ran


RULES = (
    Rule(
        RULE_SERVER_ONE_CORE_BOUND,
        server_one_core_bound,
        gives_way_to=(GiveWay(RULE_FRONT_CPU_BOUND), GiveWay(RULE_HOST_CONTENDED, _starved)),
    ),
    # Other work that took the host's cores is why the server's threads waited.
    Rule(
        RULE_SERVER_THREADS_WAIT_FOR_CPU,
        server_threads_wait_for_cpu,
        gives_way_to=(GiveWay(RULE_HOST_CONTENDED),),
    ),
)

"""The rule on other work that filled the host: `host_contended` (processes outside the
server, its children and the lab took the cores they needed; `RunFacts.contention`). It
explains of each slow gap what the host's late wake-ups can add (`signatures.HostDelays`)
and, where cadence measured it per step, what its steps' threads waited for a CPU
(`signatures.StepsWaitedForCpu`); without the raw records or the wake-ups measured, the tail
as a whole."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.coincidence import attribution
from cadence.lab.analysis.diagnosis.facts import RunFacts, rounded
from cadence.lab.analysis.diagnosis.names import RULE_HOST_CONTENDED
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.analysis.diagnosis.signatures import HostDelays, StepsWaitedForCpu
from cadence.lab.results import Finding


def host_contended(facts: RunFacts) -> list[Finding]:
    found = facts.contention
    if found is None:
        return []
    evidence: dict = {
        "host_cpus": found.cpus,
        "host_busy_cores": rounded(found.busy / 100),
        "others_cores": rounded(found.others / 100),
        "server_cores": rounded(found.server / 100),
        "client_cores": rounded(found.client / 100),
        "lab_cores": rounded(found.lab / 100),
    }
    threads = facts.result.server_threads or None
    if threads:
        evidence["server_waited_for_cpu_cores"] = rounded(
            sum(g.wait_for_cpu_pct for g in threads.groups) / 100
        )
    host = facts.result.system.host
    # `contention` found the host sampled (else `found` is None).
    named = (
        ", ".join(f"{o.name} (pid {o.pid}) {o.cpu_pct:.0f}%" for o in host.others) if host else ""
    )
    if named:
        evidence["other_processes"] = named
    tail = attribution(facts)
    waited = tail.signature(StepsWaitedForCpu) if tail is not None else None
    if waited is not None and waited.rule == RULE_HOST_CONTENDED:
        evidence.update(waited.evidence)  # the steps' own waits for a CPU (cadence's figure)
    late = tail.signature(HostDelays) if tail is not None else None
    if tail is not None and late is not None:
        # Explicit shares, zeros included: the host explains what its wake-ups (and its
        # steps' measured waits for a CPU) can add to each slow gap, not a whole tail (a
        # server's own 150 ms stall stays the server's). Only of a tail the reading saw,
        # though: where no gap or first output was slow by its yardstick (a first output is
        # slow from 100 ms), a tail the verdict judges bad below that is one this reading
        # cannot split, and a share of 0 would call it the server's; the host then bears on
        # it without a share.
        evidence.update(late.evidence)
        if tail.itl_total_ms > 0:
            evidence["itl_tail_share"] = round(tail.itl_share(RULE_HOST_CONTENDED), 3)
        if tail.ttft_total_ms > 0:
            evidence["ttft_tail_share"] = round(tail.ttft_share(RULE_HOST_CONTENDED), 3)
    return [
        Finding(
            rule=RULE_HOST_CONTENDED,
            finding=(
                f"other work on this host used {found.others / 100:.1f} of its {found.cpus} "
                f"cores during the run{f' ({named})' if named else ''}, and the host had no "
                "core to spare: the server's and the client's threads waited for CPUs, so "
                "this run's tails are partly the host's"
            ),
            evidence=evidence,
            look_at=(
                "measure on a quiet host, or give the server and the load cores no other job "
                "uses (taskset, cgroup cpusets); top or pidstat names the other work"
            ),
        )
    ]


RULES = (Rule(RULE_HOST_CONTENDED, host_contended),)

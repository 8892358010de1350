"""Where the tail's time goes, by what coincided with each slow gap and each slow first output.

The tail is what the slow gaps and the slow first outputs took beyond one typical gap (their
excess, `reads`). Each signature (`signatures`) recognised over the run claims, in turn, the
part of each one's remaining excess it explains: most specific first (outputs held back in a
read, then what a slow step's threads waited for a CPU where the server measured it per step,
then the streams that joined at that instant, then the engine's own slow step where the
server's timing shows it, then a silence of every stream, then a slower subset, then a
timer among what is left (at any position: gaps at the positions of a period of the stream,
`dependence`, are where the stream is, not a clock), then the lab's own client where its loop
ran late as the gap ended, then new requests sent inside the gap where the slow gaps left
hold the run's sends beyond chance (the server's handling of new calls held the running
streams), then, on a host other work filled, the host's late wake-ups, up to
what they can add). A slow first output is claimed by its step's measured wait for a CPU and
the same instants, then by a fixed first cost, then by the request's own size where the first
outputs follow it (`dependence`: a prefill, a scheduler that orders by length), then by a
slot. A cause's share is the tail time it claimed over the whole tail; what no signature
claimed stays `unexplained`, with the gaps it is in.
A rule reads its own share (`itl_share`, `ttft_share`) and decides whether it is a finding.
"""

from __future__ import annotations

import weakref
from typing import TypeVar, cast

from cadence.lab.analysis import dependence
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.reads import NS_PER_MS, Gap, Reads
from cadence.lab.analysis.diagnosis.signatures import (
    ArrivalStalls,
    BurstSpread,
    ClientStalls,
    FixedFirstCost,
    FixedGaps,
    FollowsOwnSize,
    HandOffGaps,
    HeldBack,
    HostDelays,
    OneAtATime,
    PrefillPoolWait,
    PrefillStalls,
    SharedStalls,
    Signature,
    SlowGroup,
    SlowSteps,
    StepsWaitedForCpu,
    WaitsForSlot,
)
from cadence.lab.analysis.tail_bound import tails
from cadence.lab.results import TailVerdict

S = TypeVar("S", bound=Signature)

GAP_SIGNATURES: tuple[type[Signature], ...] = (
    HeldBack,
    HandOffGaps,
    StepsWaitedForCpu,
    PrefillStalls,
    SlowSteps,
    SharedStalls,
    SlowGroup,
)
"""Claim each slow gap's excess in this order; `FixedGaps` then reads what they left. A gap
across a hand-off (disaggregated serving) is the hand-off's whole. A step's measured wait for
a CPU (cadence's per-step figure) comes before the causes that are estimated: it is what that
step's threads lost, in that step. A slow step of the engine's own (the server's timing)
comes after prefill, which names why a step was slow, and before a silence of every stream,
which a slow step also makes."""

FIRST_SIGNATURES: tuple[type[Signature], ...] = (
    HeldBack,
    PrefillPoolWait,
    StepsWaitedForCpu,
    PrefillStalls,
    SharedStalls,
    FixedFirstCost,
    WaitsForSlot,
    BurstSpread,
)
"""Claim each slow first output's excess in this order (one made on a prefill worker of a
disaggregated server: its wait and its prefill there, before any cause the streams share;
then what its step's threads waited for a CPU, measured)."""


class Attribution:
    """The tail time of a run, by cause."""

    def __init__(self, reads: Reads, facts: RunFacts) -> None:
        self.reads = reads
        self.itl_total_ms = reads.itl_excess_ms()
        self.ttft_total_ms = reads.ttft_excess_ms()
        self.itl_ms: dict[str, float] = {}
        self.ttft_ms: dict[str, float] = {}
        found: dict[type[Signature], Signature | None] = {}
        for kind in dict.fromkeys((*GAP_SIGNATURES, *FIRST_SIGNATURES)):
            found[kind] = kind.detect(reads, facts)
        self.signatures: dict[type[Signature], Signature] = {k: s for k, s in found.items() if s}
        """Each signature recognised in the run, by its kind."""
        self.tables = dependence.tables(facts.result.records or [], reads)
        """What the gaps and the first outputs depend on (`dependence`), read once a run."""
        left = self._claim_gaps([s for k in GAP_SIGNATURES if (s := found[k])])
        untouched = {id(g) for g, r in left if r >= g.excess_ms}
        # A clock ends gaps at one value at any position; gaps at the positions of a period
        # of the stream (a wait every K tokens) have that value because of where they are.
        gap_table = self.tables[dependence.GAP]
        period = gap_table.period if gap_table is not None else None
        timer = FixedGaps.among(
            reads, [g for g, _ in left if id(g) in untouched and not _on(period, g)]
        )
        if timer is not None:
            self.signatures[FixedGaps] = timer
            left = self._claim_left(left, timer, untouched)
        # Then the lab's own client, where its loop ran late when a gap ended: a stamp it
        # made late, up to how long its loop had been late.
        client = ClientStalls.detect(reads, facts)
        if client is not None:
            self.signatures[ClientStalls] = client
            left = self._claim_left(left, client)
        # Then new requests' arrivals, where the slow gaps still unexplained hold the run's
        # sends beyond chance: the server's handling of new calls held the running streams.
        arrivals = ArrivalStalls.among(reads, [g for g, r in left if r > 0])
        if arrivals is not None:
            self.signatures[ArrivalStalls] = arrivals
            left = self._claim_left(left, arrivals)
        # Last: a busy host's late wake-ups claim only what no cause of the server's did.
        host = HostDelays.detect(reads, facts)
        if host is not None:
            self.signatures[HostDelays] = host
            left = self._claim_left(left, host)
        self.unexplained_gaps = [(g, r) for g, r in left if r > 0]
        """Each slow gap with tail time no signature claimed, and that time (ms)."""
        own = FollowsOwnSize.among(self.tables[dependence.FIRST])
        if own is not None:
            self.signatures[FollowsOwnSize] = own
        firsts = [s for k in FIRST_SIGNATURES if (s := found[k])]
        # The request's own size claims before a slot: a slot makes a request wait for those
        # ahead of it, whatever its size.
        at = next(
            (i for i, s in enumerate(firsts) if isinstance(s, WaitsForSlot | BurstSpread)),
            len(firsts),
        )
        if own is not None:
            firsts.insert(at, own)
        self._claim_firsts(firsts + [s for s in (client, host) if s is not None])
        serial = OneAtATime.detect(reads, facts)
        if serial is not None:
            self.signatures[OneAtATime] = serial

    @staticmethod
    def _take(into: dict[str, float], signature: Signature, ms: float) -> float:
        if ms > 0:
            into[signature.rule] = into.get(signature.rule, 0.0) + ms
        return max(ms, 0.0)

    def _claim_gaps(self, signatures: list[Signature]) -> list:
        left = []
        for gap in self.reads.slow:
            remaining = gap.excess_ms
            for signature in signatures:
                if remaining <= 0:
                    break
                remaining -= self._take(self.itl_ms, signature, signature.claim_gap(gap, remaining))
            left.append((gap, remaining))
        return left

    def _claim_left(self, left: list, signature: Signature, among: set[int] | None = None) -> list:
        """`signature` claims from what other signatures left of each slow gap (of the gaps
        whose ids are `among`, when given)."""
        return [
            (g, r - self._take(self.itl_ms, signature, signature.claim_gap(g, r)))
            if r > 0 and (among is None or id(g) in among)
            else (g, r)
            for g, r in left
        ]

    def _claim_firsts(self, signatures: list[Signature]) -> None:
        self.unexplained_firsts = []
        """Each slow first output's stream with time no signature claimed, and that time."""
        for stream in self.reads.slow_firsts:
            remaining = stream.ttft_ms - self.reads.typical_ms
            for signature in signatures:
                if remaining <= 0:
                    break
                remaining -= self._take(
                    self.ttft_ms, signature, signature.claim_first(stream, remaining)
                )
            if remaining > 0:
                self.unexplained_firsts.append((stream, remaining))

    def signature(self, kind: type[S]) -> S | None:
        """The signature of that kind when the run carries it."""
        # Each kind maps to a signature of that kind (`__init__`), which a dict cannot say.
        return cast("S | None", self.signatures.get(kind))

    def itl_share(self, rule: str) -> float:
        """The share of the gaps' tail time `rule`'s signature explains (0 without a tail)."""
        return self.itl_ms.get(rule, 0.0) / self.itl_total_ms if self.itl_total_ms else 0.0

    def ttft_share(self, rule: str) -> float:
        """The share of the first outputs' tail time `rule`'s signature explains."""
        return self.ttft_ms.get(rule, 0.0) / self.ttft_total_ms if self.ttft_total_ms else 0.0

    @property
    def unexplained_itl_ms(self) -> float:
        return sum(r for _, r in self.unexplained_gaps)

    @property
    def unexplained_ttft_ms(self) -> float:
        return sum(r for _, r in self.unexplained_firsts)

    def shares(self, rule: str) -> dict:
        """The evidence every coincidence finding carries: its part of each tail."""
        # A share of none is left unsaid: a finding that fired on other evidence (the
        # timeline's tallies) does explain the tail, by an amount this reading cannot tell.
        out: dict = {"typical_gap_ms": round(self.reads.typical_ms, 2)}
        if self.itl_ms.get(rule):
            out["itl_tail_share"] = round(self.itl_share(rule), 3)
            out["itl_tail_ms"] = round(self.itl_ms.get(rule, 0.0), 1)
            out["itl_tail_total_ms"] = round(self.itl_total_ms, 1)
        if self.ttft_ms.get(rule):
            out["ttft_tail_share"] = round(self.ttft_share(rule), 3)
            out["ttft_tail_ms"] = round(self.ttft_ms.get(rule, 0.0), 1)
            out["ttft_tail_total_ms"] = round(self.ttft_total_ms, 1)
        return out

    def seconds_into_run(self, t_ns: int) -> float:
        """`t_ns` as seconds from the run's first request."""
        start = min(s.start_ns for s in self.reads.streams)
        return (t_ns - start) / NS_PER_MS / 1e3


def _on(period: tuple[int, int] | None, gap: Gap) -> bool:
    """Whether the gap ends at a position of the period (K, residue)."""
    if not period:
        return False
    k, residue = period
    return sum(gap.stream.tokens[: gap.read]) % k == residue


_attributions: weakref.WeakKeyDictionary[RunFacts, Attribution | None] = weakref.WeakKeyDictionary()


def attribution(facts: RunFacts) -> Attribution | None:
    """The run's tail by cause, computed once per run; None without the raw records or too
    few gaps to read coincidences from."""
    if facts not in _attributions:
        records = facts.result.records or []
        reads = Reads(records) if records else None
        _attributions[facts] = (
            Attribution(reads, facts) if reads is not None and reads.usable else None
        )
    return _attributions[facts]


def judged_tails(facts: RunFacts) -> list[TailVerdict]:
    """The run's tails as the verdict judges them, by the same bounds (`tail_bound.tails`)."""
    tail = attribution(facts)
    return tails(facts.result, tail.reads.typical_ms if tail is not None else None)


def bad_tails(facts: RunFacts) -> list[str]:
    """The tails the verdict judges bad ("itl_ms", "ttft_ms"): a rule that explains a tail
    speaks only of one the verdict calls bad."""
    return [t.metric for t in judged_tails(facts) if t.state == "bad"]


def recognised(
    facts: RunFacts, kind: type[S], min_itl_share: float = 0.0
) -> tuple[Attribution, S] | None:
    """The run's attribution and its signature of `kind`, when the run carries that signature
    and it explains at least `min_itl_share` of the gaps' tail; else None."""
    tail = attribution(facts)
    signature = tail.signature(kind) if tail else None
    if (
        tail is None
        or signature is None
        or (min_itl_share and tail.itl_share(signature.rule) < min_itl_share)
    ):
        return None
    return tail, signature

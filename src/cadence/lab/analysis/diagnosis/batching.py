"""Rules on how the engine batches its streams, from client timestamps alone (any protocol):
`prefill_stalls_decode` (slow gaps end when other streams get their first output: their
prefill runs inside the step every stream waits for) and `one_stream_at_a_time` (outputs of
different streams never arrive together and the gaps grow with the streams open: no
batching). The signatures are in `signatures`; these say what they mean."""

from __future__ import annotations

from cadence.lab.analysis.diagnosis.coincidence import recognised
from cadence.lab.analysis.diagnosis.facts import RunFacts
from cadence.lab.analysis.diagnosis.names import (
    RULE_ONE_STREAM_AT_A_TIME,
    RULE_PREFILL_STALLS_DECODE,
)
from cadence.lab.analysis.diagnosis.rule import Rule
from cadence.lab.analysis.diagnosis.signatures import OneAtATime, PrefillStalls
from cadence.lab.results import Finding

PREFILL_MIN_SHARE = 0.1
"""Prefill is named when it explains at least this share of the gaps' tail time."""

SERIAL_GROWTH_RATIO = 0.75
SERIAL_MIN_LOW_GAPS = 5
"""Gaps grow with the streams open when, with half the streams or fewer receiving, the median
gap is at most this share of the typical one (served in turn: about half; batched: about the
same), read where at least this many such gaps exist."""


def prefill_stalls_decode(facts: RunFacts) -> list[Finding]:
    found = recognised(facts, PrefillStalls, PREFILL_MIN_SHARE)
    if found is None:
        return []
    tail, signature = found
    ev = signature.evidence
    per_token = (
        f" ({ev['ms_per_new_prompt_token']:.2f} ms per prompt token)"
        if "ms_per_new_prompt_token" in ev
        else ""
    )
    ttft = (
        f" and {tail.ttft_share(RULE_PREFILL_STALLS_DECODE):.0%} of the first outputs' tail"
        if tail.ttft_ms.get(RULE_PREFILL_STALLS_DECODE)
        else ""
    )
    return [
        Finding(
            rule=RULE_PREFILL_STALLS_DECODE,
            finding=(
                f"slow gaps coincide with other streams starting: "
                f"{ev['slow_share_of_those']:.0%} of the {ev['gaps_ending_with_new_streams']} "
                f"gaps that ended with a new stream's first output were slow, against "
                f"{ev['slow_share_of_other_gaps']:.0%} of the others; each new stream adds "
                f"about {ev['ms_per_new_stream']:.0f} ms{per_token} to a step that every "
                f"stream on its card waits for. Prefill inside the decode step explains "
                f"{tail.itl_share(RULE_PREFILL_STALLS_DECODE):.0%} of the gaps' tail{ttft}"
            ),
            evidence={**ev, **tail.shares(RULE_PREFILL_STALLS_DECODE)},
            look_at=(
                "split prefill from decode: chunked prefill (vLLM --enable-chunked-prefill "
                "with --max-num-batched-tokens, SGLang --chunked-prefill-size), a prefill "
                "budget per step (tokens or new sequences admitted per step), or prefill on "
                "other cards (disaggregated prefill); shorter prompts cost less"
            ),
        )
    ]


def one_stream_at_a_time(facts: RunFacts) -> list[Finding]:
    found = recognised(facts, OneAtATime)
    if found is None:
        return []
    tail, signature = found
    ev = signature.evidence
    low = ev.get("gap_p50_with_half_the_streams_or_fewer_ms")
    low_gaps = ev.get("gaps_with_half_the_streams_or_fewer", 0)
    if low is not None and low_gaps >= SERIAL_MIN_LOW_GAPS:
        if low > SERIAL_GROWTH_RATIO * ev["typical_gap_ms"]:
            return []  # the gaps do not grow with the streams: a batch, however it is read
        growth = (
            f"; with half the streams or fewer receiving, the gap was {low:.1f} ms "
            f"against {ev['typical_gap_ms']:.1f} ms"
        )
        decide = ""
    else:
        growth = ""
        decide = (
            "; a run with --concurrency 1 decides it: served in turn, one stream alone "
            f"gets a gap of about {ev['ms_per_open_stream']:.1f} ms"
        )
    return [
        Finding(
            rule=RULE_ONE_STREAM_AT_A_TIME,
            finding=(
                f"outputs of different streams never arrive together: inside one stream's "
                f"gap the others keep receiving (the longest silence is "
                f"{ev['silence_share_of_gap_p50']:.0%} of the gap at the median, where a "
                f"batch leaves most of it silent), and the gap is about "
                f"{ev['ms_per_open_stream']:.1f} ms per stream open "
                f"({ev['streams_receiving_p50']:g} at the median){growth}: the engine serves one stream at a time{decide}"
            ),
            evidence={**ev, **tail.shares(RULE_ONE_STREAM_AT_A_TIME)},
            look_at=(
                "batch the streams: one engine loop stepping every open stream together "
                "(continuous batching) instead of a generate() call per request; a lock "
                "around the model call, a worker pool of one, or a queue drained one request "
                "at a time serialises them"
            ),
        )
    ]


RULES = (
    Rule(RULE_PREFILL_STALLS_DECODE, prefill_stalls_decode),
    Rule(RULE_ONE_STREAM_AT_A_TIME, one_stream_at_a_time),
)

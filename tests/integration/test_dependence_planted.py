"""The lab names what the latency depends on (issue 51), on engine-shaped planted servers
(tests/engine_shaped_servers.py: one engine loop stepping a batch of streams) whose faults
are written as their causes, not as the rules' shapes: no KV cache (each step recomputes the
context of its batch), a leak (each step scans a record of every step before it), prefill as
the square of the prompt, a stream that waits out of the batch for a new block every K
tokens, a scheduler that admits the shortest output first. Each must be named by its variable
and shape with a share of its tail; a clean server whose steps jitter and whose lengths vary
must name none. Each run takes 2-6 s after the load generator's start.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cadence.lab.analysis.diagnosis.names import RULE_ITL_DEPENDS_ON, RULE_TTFT_DEPENDS_ON
from tests.integration.host_load import contended
from tests.integration.test_engine_shaped_diagnosis import Case, bench, explain

pytestmark = [pytest.mark.alone, pytest.mark.slow]


@dataclass(frozen=True)
class Planted:
    case: Case
    rule: str
    variables: frozenset[str]
    shapes: frozenset[str]


GROWS = frozenset({"linear", "faster_than_linear", "monotone", "step"})

PLANTED = {
    "no-kv-cache-grpc": Planted(
        Case(
            "grpc",
            ("--no-kv-cache-ms-per-token", "0.25", "--decode-ms", "1"),
            frozenset(),
            streams=2,
            requests=4,
            max_tokens=(100, 100),
            prompt_tokens=(4, 8),
        ),
        RULE_ITL_DEPENDS_ON,
        frozenset({"context_in_flight", "position"}),
        GROWS,
    ),
    "leak-grpc": Planted(
        Case(
            "grpc",
            ("--leak-ms-per-step", "0.1", "--decode-ms", "2"),
            frozenset(),
            streams=8,
            requests=48,
            max_tokens=(30, 60),
        ),
        RULE_ITL_DEPENDS_ON,
        frozenset({"time_in_run_s", "tokens_sent"}),
        GROWS,
    ),
    "block-16-grpc": Planted(
        Case(
            "grpc",
            ("--block-tokens", "16", "--block-ms", "40", "--decode-ms", "8"),
            frozenset(),
            max_tokens=(40, 100),
        ),
        RULE_ITL_DEPENDS_ON,
        frozenset({"position"}),
        frozenset({"periodic"}),
    ),
    "prefill-square-sse": Planted(
        Case(
            "sse",
            ("--prefill-ms-per-token-squared", "0.0008", "--decode-ms", "8"),
            frozenset(),
            requests=48,
            max_tokens=(10, 30),
            prompt_tokens=(50, 700),
        ),
        RULE_TTFT_DEPENDS_ON,
        frozenset({"prompt_tokens"}),
        frozenset({"faster_than_linear", "linear"}),
    ),
    "shortest-first-grpc": Planted(
        Case(
            "grpc",
            ("--max-batch", "4", "--order-by-length", "shortest", "--decode-ms", "4"),
            frozenset(),
            max_tokens=(8, 128),
        ),
        RULE_TTFT_DEPENDS_ON,
        frozenset({"max_tokens"}),
        GROWS,
    ),
}


@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_dependence_is_named_by_its_variable_and_shape(name: str) -> None:
    planted = PLANTED[name]
    result = bench(planted.case)
    found = [f for f in result.diagnosis if f.rule == planted.rule]
    assert found, explain(result)
    top = found[0].evidence
    if contended(result) and top["variable"] not in planted.variables:
        return  # another job's stalls of the host can outweigh a planted slope
    assert top["variable"] in planted.variables, explain(result)
    assert top["shape"] in planted.shapes, explain(result)
    share = top["itl_tail_share" if planted.rule == RULE_ITL_DEPENDS_ON else "ttft_tail_share"]
    assert share >= 0.25, explain(result)
    assert top["size"] and "ms" in str(top["size"])
    if top["shape"] == "periodic":  # a wait every K positions is no clock (issue 51, item 2)
        assert "gaps_at_fixed_values" not in {f.rule for f in result.diagnosis}
    assert (
        planted.rule in result.verdict.line
        or result.verdict.state != "unhealthy"
        or any(planted.rule in t.explained_by for t in result.verdict.tails)
    ), result.verdict.line


@pytest.mark.parametrize("front", ["grpc", "sse"])
def test_a_clean_server_with_varied_lengths_depends_on_nothing(front: str) -> None:
    result = bench(
        Case(
            front,
            ("--jitter", "0.25"),
            frozenset(),
            requests=48,
            max_tokens=(10, 120),
            prompt_tokens=(10, 400),
        )
    )
    rules = {f.rule for f in result.diagnosis}
    assert not rules & {RULE_ITL_DEPENDS_ON, RULE_TTFT_DEPENDS_ON}, explain(result)

"""The planted causes whose dependence the lab must name (issue 51), each with several
parameter sets on both fronts of tests/engine_shaped_servers.py (gRPC and OpenAI SSE), and
clean servers with jitter and varied lengths that must name none. Shared by
tests/integration/test_dependence_planted.py (one run of each) and
benchmarks/dependence_named.py (many).

Each fault is the engine's cause, written without the rules: no KV cache (every step
recomputes the batch's context), a leak (each step scans a record of every step before it),
prefill as the square of the prompt, a stream that waits out of the batch for a new block
every K tokens, a scheduler that admits by output budget; and two the taught signatures
were not written against: a front that waits for storage every K outputs of a stream (gaps
of one value, as a clock's, but at fixed positions), a KV cache reserved per whole output
that admits the shortest first (requests starved by their length with no cap on the count
of streams, which a slot limit does not explain)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cadence.lab.analysis.diagnosis.names import RULE_ITL_DEPENDS_ON, RULE_TTFT_DEPENDS_ON
from tests.integration.test_engine_shaped_diagnosis import Case

GROWS = frozenset({"linear", "faster_than_linear", "monotone", "step"})
"""The shapes a dependence that rises with its variable may take on a noisy host."""


@dataclass(frozen=True)
class Planted:
    """One cause: the finding that must name it and its parameter sets (server and load)."""

    rule: str
    variables: frozenset[str]
    """The variables it may be named by (those the run cannot tell apart from its own)."""
    shapes: frozenset[str]
    cases: tuple[Case, ...]
    """Its parameter sets, each on the gRPC front; `on(front)` gives the SSE ones."""
    misnamed_by: frozenset[str] = frozenset()
    """Taught signatures whose claim the cause contradicts: they must not name it."""

    def on(self, front: str) -> tuple[Case, ...]:
        return tuple(replace(c, front=front) for c in self.cases)


def _case(server: tuple[str, ...], **load) -> Case:
    return Case("grpc", server, frozenset(), **load)


PLANTED: dict[str, Planted] = {
    # Attention over the whole context each step: the step grows with the batch's tokens.
    "no-kv-cache": Planted(
        RULE_ITL_DEPENDS_ON,
        frozenset({"context_in_flight", "position"}),
        GROWS,
        (
            _case(
                ("--no-kv-cache-ms-per-token", "0.25", "--decode-ms", "1"),
                streams=2,
                requests=4,
                max_tokens=(100, 100),
                prompt_tokens=(4, 8),
            ),
            _case(
                ("--no-kv-cache-ms-per-token", "0.15", "--decode-ms", "1", "--jitter", "0.1"),
                streams=3,
                requests=6,
                max_tokens=(100, 100),
                prompt_tokens=(4, 8),
            ),
        ),
    ),
    # Every step scans a record of all the steps before it.
    "leak": Planted(
        RULE_ITL_DEPENDS_ON,
        frozenset({"time_in_run_s", "tokens_sent"}),
        GROWS,
        (
            _case(
                ("--leak-ms-per-step", "0.15", "--decode-ms", "2"),
                streams=8,
                requests=40,
                max_tokens=(30, 60),
            ),
            _case(
                ("--leak-ms-per-step", "0.25", "--decode-ms", "1", "--jitter", "0.1"),
                streams=8,
                requests=32,
                max_tokens=(30, 50),
            ),
        ),
    ),
    # A stream that fills a block of K tokens waits out of the batch for its next one.
    "block": Planted(
        RULE_ITL_DEPENDS_ON,
        frozenset({"position"}),
        frozenset({"periodic"}),
        (
            _case(
                ("--block-tokens", "16", "--block-ms", "40", "--decode-ms", "8"),
                max_tokens=(40, 100),
            ),
            _case(
                ("--block-tokens", "8", "--block-ms", "30", "--decode-ms", "5", "--jitter", "0.1"),
                max_tokens=(30, 60),
            ),
        ),
        misnamed_by=frozenset({"gaps_at_fixed_values"}),
    ),
    # Prefill on an instance of its own, as the square of the prompt (no flash kernel).
    "prefill-square": Planted(
        RULE_TTFT_DEPENDS_ON,
        frozenset({"prompt_tokens"}),
        frozenset({"faster_than_linear", "linear"}),
        (
            _case(
                ("--prefill-ms-per-token-squared", "0.0008", "--decode-ms", "8"),
                requests=48,
                max_tokens=(10, 30),
                prompt_tokens=(50, 700),
            ),
            _case(
                ("--prefill-ms-per-token-squared", "0.0003", "--decode-ms", "5", "--jitter", "0.1"),
                requests=48,
                max_tokens=(10, 30),
                prompt_tokens=(100, 1000),
            ),
        ),
    ),
    # A scheduler with few slots that admits the shortest output budget first.
    "shortest-first": Planted(
        RULE_TTFT_DEPENDS_ON,
        frozenset({"max_tokens"}),
        GROWS,
        (
            _case(
                ("--max-batch", "4", "--order-by-length", "shortest", "--decode-ms", "4"),
                max_tokens=(8, 128),
            ),
            _case(
                ("--max-batch", "6", "--order-by-length", "shortest", "--decode-ms", "3"),
                streams=24,
                requests=64,
                max_tokens=(16, 96),
            ),
        ),
    ),
    # Each stream's front waits for storage after every K outputs (the engine goes on).
    "wait-every-k-outputs": Planted(
        RULE_ITL_DEPENDS_ON,
        frozenset({"position"}),
        frozenset({"periodic"}),
        (
            _case(
                ("--sync-every", "16", "--sync-ms", "40", "--decode-ms", "6", "--jitter", "0.1"),
                max_tokens=(40, 90),
            ),
            _case(
                ("--sync-every", "8", "--sync-ms", "25", "--decode-ms", "4"),
                streams=12,
                max_tokens=(30, 60),
            ),
        ),
        misnamed_by=frozenset({"gaps_at_fixed_values"}),
    ),
    # A KV cache reserved for each stream's whole output, the shortest admitted first among
    # those that fit: no cap on the count of streams, the long ones starve.
    "token-budget": Planted(
        RULE_TTFT_DEPENDS_ON,
        frozenset({"max_tokens"}),
        GROWS,
        (
            _case(("--token-budget", "200", "--decode-ms", "4"), max_tokens=(8, 128)),
            _case(
                ("--token-budget", "300", "--decode-ms", "3", "--jitter", "0.1"),
                streams=24,
                requests=64,
                max_tokens=(16, 160),
            ),
        ),
    ),
}

CLEAN: tuple[Case, ...] = (
    _case(("--jitter", "0.25"), requests=48, max_tokens=(10, 120), prompt_tokens=(10, 400)),
    _case(
        ("--jitter", "0.2", "--cards", "2", "--decode-ms", "6"),
        streams=24,
        requests=64,
        max_tokens=(20, 80),
        prompt_tokens=(50, 800),
    ),
    _case(
        ("--jitter", "0.3", "--decode-ms", "15"),
        streams=8,
        requests=32,
        max_tokens=(5, 60),
        prompt_tokens=(1, 200),
    ),
)
"""Clean servers: steps that vary, lengths that vary, one or two cards; on `on_fronts`."""


def planted_period(case: Case) -> int | None:
    """The K of a planted wait every K outputs, from the server's arguments."""
    for flag in ("--block-tokens", "--sync-every"):
        if flag in case.server:
            return int(case.server[case.server.index(flag) + 1])
    return None


def on_fronts(cases: tuple[Case, ...]) -> tuple[Case, ...]:
    """Each case on the gRPC front and on the SSE one."""
    return tuple(replace(c, front=f) for c in cases for f in ("grpc", "sse"))


__all__ = ["CLEAN", "GROWS", "PLANTED", "Planted", "on_fronts", "planted_period"]

"""The dependence analysis (`cadence.lab.analysis.dependence`, rules `itl_depends_on` and
`ttft_depends_on`) on records built by hand: a simulated engine that steps a batch of streams
in a closed loop, each fault written as its cause (a step that costs the batch's context, a
step that grows with the steps done, a prefill as the square of the prompt, a stream that
waits out of the batch for a new block every K tokens, a scheduler that admits the shortest
first), and clean runs whose steps jitter and whose lengths vary, which must stay clean."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from cadence.lab.analysis import dependence
from cadence.lab.analysis.diagnosis import diagnose
from cadence.lab.analysis.diagnosis.reads import Reads
from cadence.lab.analysis.verdict import RULE_UNEXPLAINED_TAIL, judge
from cadence.lab.records import RequestRecord
from tests.unit.lab.test_coincidence import as_bench

MS = 1_000_000


@dataclass
class Stream:
    number: int
    client: int
    sent: int
    prompt: int
    max_tokens: int
    made: int = 0
    parked_until: int = 0
    ready: int = 0
    arrivals: list[int] = field(default_factory=list)


@dataclass
class Engine:
    """A simulated engine: `step_ms(running, admitted, steps)` is one step's cost."""

    step_ms: Callable[[list[Stream], list[Stream], int], float] = lambda r, a, n: 10.0
    jitter: float = 0.1
    max_batch: int = 0
    shortest_first: bool = False
    block_tokens: int = 0
    block_ms: float = 0.0
    rare_every: int = 0
    """One gap in this many, at random, late by 60-240 ms (a tail of no shape)."""
    rare_ms: tuple[float, float] = (60.0, 240.0)
    prefill_ms: Callable[[int], float] = lambda prompt: 0.0
    """Each stream's prefill on a prefill instance of its own, before it joins the batch."""


def simulate(
    engine: Engine,
    streams: int = 16,
    requests: int = 64,
    prompts: tuple[int, int] = (16, 16),
    outputs: tuple[int, int] = (30, 30),
    seed: int = 0,
) -> list[RequestRecord]:
    """A closed loop of `streams` clients over `requests` requests on `engine`."""
    rng = random.Random(seed)
    now = 0
    sent = 0
    waiting: list[Stream] = []
    running: list[Stream] = []
    done: list[Stream] = []
    steps = 0

    def send(client: int, at: int) -> None:
        nonlocal sent
        if sent < requests:
            prompt = rng.randint(*prompts)
            stream = Stream(sent, client, at + 50_000, prompt, rng.randint(*outputs))
            stream.ready = stream.sent + int(engine.prefill_ms(prompt) * MS)
            waiting.append(stream)
            sent += 1

    for c in range(streams):
        send(c, c * 20_000)
    while waiting or running:
        if not running and waiting and min(s.ready for s in waiting) > now:
            now = min(s.ready for s in waiting)
        ready = [s for s in waiting if s.ready <= now]
        if engine.shortest_first:
            ready.sort(key=lambda s: s.max_tokens)
        admitted = []
        for s in ready:
            if engine.max_batch and len(running) >= engine.max_batch:
                break
            waiting.remove(s)
            running.append(s)
            admitted.append(s)
        if not running:
            now = min(s.ready for s in waiting)
            continue
        cost = engine.step_ms(running, admitted, steps) * max(0.2, rng.gauss(1, engine.jitter))
        now += int(cost * MS)
        steps += 1
        for s in list(running):
            if s.parked_until > now:
                continue
            late = 0
            if engine.rare_every and rng.random() < 1 / engine.rare_every:
                late = int(rng.uniform(*engine.rare_ms) * MS)
            s.arrivals.append(now + 30_000 + late)
            s.made += 1
            if engine.block_tokens and s.made % engine.block_tokens == 0:
                s.parked_until = now + int(engine.block_ms * MS)
            if s.made >= s.max_tokens:
                running.remove(s)
                done.append(s)
                send(s.client, s.arrivals[-1])
    records = []
    for s in sorted(done, key=lambda s: s.number):
        arrivals = sorted(s.arrivals)
        n = len(arrivals)
        records.append(
            RequestRecord(
                request_id=f"bench-{s.number}",
                process=s.client % 2,
                start_ns=s.sent,
                end_ns=arrivals[-1],
                prompt_tokens=s.prompt,
                max_tokens=s.max_tokens,
                finish_reason=2,
                arrival_ns=arrivals,
                tokens=[1] * n,
                index=list(range(n)),
            )
        )
    return records


def findings(records: list[RequestRecord]) -> dict[str, dict]:
    result = as_bench(records)
    result.diagnosis = diagnose(result)
    result.verdict, more = judge(result)
    result.diagnosis += more
    return {f.rule: f.evidence for f in result.diagnosis}


def named(records: list[RequestRecord], latency: str) -> list[dependence.Dependence]:
    table = dependence.tables(records)[latency]
    assert table is not None
    return table.named


def no_kv_cache(per_token_ms: float) -> Engine:
    return Engine(
        step_ms=lambda running, admitted, n: (
            5.0 + per_token_ms * sum(s.prompt + s.made for s in running)
        )
    )


CASES = {
    # Every step recomputes each stream's prompt and output (no KV cache).
    "no-kv-cache": (
        lambda seed: simulate(
            no_kv_cache(0.1), streams=6, requests=24, prompts=(16, 64), outputs=(20, 250), seed=seed
        ),
        "gap",
        "context_in_flight",
        {"linear", "monotone"},
    ),
    # A list kept every step and scanned every step (a leak).
    "leak": (
        lambda seed: simulate(
            Engine(step_ms=lambda r, a, n: 5.0 + 0.1 * n), outputs=(20, 60), seed=seed
        ),
        "gap",
        {"time_in_run_s", "tokens_sent"},
        {"linear", "monotone", "faster_than_linear"},
    ),
    # A stream waits out of the batch for a new block every 16 tokens.
    "block-16": (
        lambda seed: simulate(Engine(block_tokens=16, block_ms=40), outputs=(40, 100), seed=seed),
        "gap",
        "position",
        {"periodic"},
    ),
    # Prefill on an instance of its own per stream, as the square of the prompt.
    "prefill-square": (
        lambda seed: simulate(
            Engine(prefill_ms=lambda prompt: 0.0008 * prompt**2),
            prompts=(50, 700),
            outputs=(10, 30),
            seed=seed,
        ),
        "ttft",
        "prompt_tokens",
        {"faster_than_linear"},
    ),
    # At most 4 streams run; the waiting ones are admitted shortest output first.
    "shortest-first": (
        lambda seed: simulate(
            Engine(max_batch=4, shortest_first=True), outputs=(8, 128), seed=seed
        ),
        "ttft",
        "max_tokens",
        {"step", "linear", "monotone", "faster_than_linear"},
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_each_planted_dependence_is_named_with_its_variable_and_shape(name: str) -> None:
    make, latency, variable, shapes = CASES[name]
    variables = {variable} if isinstance(variable, str) else variable
    for seed in range(3):
        records = make(seed)
        found = named(records, latency)
        assert found, dependence.tables(records)[latency].words()
        top = found[0]
        assert top.variable in variables, (seed, dependence.tables(records)[latency].words())
        assert top.shape in shapes, (seed, top.shape, top.size)
        assert top.size and top.cause
        rule = "itl_depends_on" if latency == "gap" else "ttft_depends_on"
        evidence = findings(records)[rule]
        assert evidence["variable"] == top.variable and evidence["shape"] == top.shape
        share = evidence["itl_tail_share" if latency == "gap" else "ttft_tail_share"]
        assert share >= dependence.MIN_TAIL_SHARE


def test_the_period_and_the_slope_are_sized_in_the_runs_units() -> None:
    [block] = named(simulate(Engine(block_tokens=16, block_ms=40), outputs=(40, 100)), "gap")[:1]
    assert block.evidence["period"] == 16
    assert "every 16" in block.size
    square = named(
        simulate(
            Engine(prefill_ms=lambda prompt: 0.0008 * prompt**2),
            prompts=(50, 700),
            outputs=(10, 30),
        ),
        "ttft",
    )[0]
    assert square.evidence["power"] >= 1.5
    assert "square" in square.size or "power" in square.size or "cube" in square.size


@pytest.mark.parametrize("seed", range(6))
def test_clean_runs_with_jitter_and_varied_lengths_stay_clean(seed: int) -> None:
    records = simulate(Engine(jitter=0.25), prompts=(10, 400), outputs=(10, 120), seed=seed)
    tables = dependence.tables(records)
    for table in tables.values():
        assert table is None or not table.named, table.words()
    rules = findings(records)
    assert "itl_depends_on" not in rules and "ttft_depends_on" not in rules


def test_a_tail_of_no_shape_stays_unexplained_and_carries_the_table() -> None:
    records = simulate(Engine(rare_every=30), outputs=(40, 60))
    rules = findings(records)
    assert "itl_depends_on" not in rules
    evidence = rules[RULE_UNEXPLAINED_TAIL]
    assert "position rho" in str(evidence["dependence"])
    assert evidence["dependence_strongest"]


def test_too_few_values_give_no_table() -> None:
    records = simulate(Engine(), streams=2, requests=2, outputs=(5, 5))
    assert dependence.tables(records)[dependence.FIRST] is None
    assert Reads(records).usable is False or dependence.tables(records)[dependence.GAP] is None


def test_the_strongest_dependence_is_kept_with_its_curve() -> None:
    """What the report draws: the latency's medians and quartiles by bin, from the result."""
    block = dependence.curves(
        dependence.tables(simulate(Engine(block_tokens=16, block_ms=40), outputs=(40, 100)))
    )
    [gap] = [c for c in block if c.latency == dependence.GAP]
    assert gap.named and gap.shape == "periodic" and gap.period == 16
    assert gap.x == [float(k) for k in range(16)]
    assert gap.median_ms[0] > 3 * max(gap.median_ms[1:])
    assert all(lo <= m <= hi for lo, m, hi in zip(gap.p25_ms, gap.median_ms, gap.p75_ms))
    square = dependence.curves(
        dependence.tables(
            simulate(
                Engine(prefill_ms=lambda prompt: 0.0008 * prompt**2),
                prompts=(50, 700),
                outputs=(10, 30),
            )
        )
    )
    [first] = [c for c in square if c.latency == dependence.FIRST]
    assert first.variable == "prompt_tokens" and first.named
    assert first.x == sorted(first.x) and first.median_ms[-1] > 5 * first.median_ms[0]
    assert sum(first.n) == 64


def test_gaps_at_a_period_of_the_stream_are_not_a_clock() -> None:
    """A 40 ms wait every 16 tokens gives gaps of one value, as a timer would, but only at
    positions 16, 32, 48...: the period names them and the clock never reads them."""
    records = simulate(Engine(block_tokens=16, block_ms=40, jitter=0.02), outputs=(40, 100))
    rules = findings(records)
    assert rules["itl_depends_on"]["shape"] == "periodic"
    assert "gaps_at_fixed_values" not in rules


def test_a_stall_of_streams_in_lockstep_is_no_period() -> None:
    """Streams opened together and never apart cross each position at the same step: a pause
    of the whole engine every 16 steps cannot be told from a wait at every 16th position,
    and no period is named (the others never went on during those gaps)."""
    records = simulate(
        Engine(step_ms=lambda r, a, n: 5.0 + (40.0 if n % 16 == 15 else 0.0), jitter=0.02),
        streams=8,
        requests=8,
        outputs=(96, 96),
    )
    table = dependence.tables(records)[dependence.GAP]
    assert table is not None
    assert not any(d.shape == "periodic" for d in table.named), table.words()

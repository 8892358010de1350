"""What the load sends: each request's plan (ids, prompt, length), how requests are made
from a seed, a trace or a set of conversations, and when they arrive in an open loop."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence

import msgspec

from cadence.lab.load.lengths import Lengths
from cadence.lab.load.trace import BLOCK_TOKENS, Prompts, TraceRow, printable


class RequestPlan(msgspec.Struct, frozen=True, array_like=True):
    """One request to send."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    number: int = 0
    """The request's number in the run (i); warm-up requests count apart."""
    turn: int = 0
    """Its turn in its conversation (1 first); 0 outside one."""
    parts: list[int] = []
    """A conversation's turn: the lengths of the messages the prompt is made of, a user's
    first and then by turns the assistant's and the user's (the chat endpoint sends them as
    messages); empty: the prompt is one message."""
    headers: list[tuple[str, str]] = []
    """Metadata (HTTP headers) of this request alone: the session's, with a session header."""
    population: str = ""
    """The client population it belongs to (`ClientMix`); "" in a run of one behaviour."""
    read_delay_s: float = -1.0
    """Its population's pause after each chunk; -1: the run's (`--read-delay-ms N`)."""
    deadline_s: float = 0.0
    """Its population's deadline; 0: the run's (`--timeout`)."""
    cancel_s: float = 0.0
    """Cancel it this long after its send (the cancelling population); 0: never."""
    request_class: str = ""
    """Its request class (`ClassMix`, `--mix`); "" in a run of one class."""


class ClientMix(msgspec.Struct, frozen=True, kw_only=True):
    """Shares of the requests that behave apart, each a population of its own: slow readers
    (`--read-delay-ms MS@SHARE%`), requests cancelled mid-stream (`--cancel-ms MS@SHARE%`)
    and requests with a deadline (`--deadline-ms MS@SHARE%`); the rest are `plain`. A
    request's population is drawn from the seed: the same in every run."""

    read_delay: tuple[float, float] = (0.0, 0.0)
    """(ms, share)."""
    cancel: tuple[float, float] = (0.0, 0.0)
    deadline: tuple[float, float] = (0.0, 0.0)

    def place(self, plan: RequestPlan, seed: int) -> RequestPlan:
        """`plan` in its population."""
        u = random.Random(seed * 1_000_003 + plan.number + 0x5EED).random()
        for name, (ms, share), field in (
            ("slow_reader", self.read_delay, "read_delay_s"),
            ("cancelling", self.cancel, "cancel_s"),
            ("deadline", self.deadline, "deadline_s"),
        ):
            if u < share:
                return msgspec.structs.replace(plan, population=name, **{field: ms / 1e3})
            u -= share
        return msgspec.structs.replace(plan, population="plain")


class RequestClass(msgspec.Struct, frozen=True, kw_only=True):
    """One class of requests of a `--mix` (`--class 'NAME prompt=SPEC max=SPEC slo=...'`):
    its lengths, each a range (LO, HI) or a distribution, and its own SLO terms."""

    name: str
    prompt_tokens: tuple[int, int] = (16, 16)
    max_tokens: tuple[int, int] = (128, 128)
    prompt_lengths: Lengths | None = None
    output_lengths: Lengths | None = None
    slo: list[str] = []
    """Its SLO terms as given (`ttft_p99_ms=200`): its goodput is judged on them alone."""

    def lengths(self, rng: random.Random) -> tuple[int, int]:
        """(prompt length, max_tokens) of one request of the class."""
        prompt = _draw(self.prompt_lengths, self.prompt_tokens, rng)
        return prompt, _draw(self.output_lengths, self.max_tokens, rng)


def _draw(lengths: Lengths | None, uniform: tuple[int, int], rng: random.Random) -> int:
    """A length from the distribution, or else uniform in [lo, hi]."""
    return lengths.draw(rng) if lengths is not None else rng.randint(*uniform)


class ClassMix(msgspec.Struct, frozen=True, kw_only=True):
    """`--mix 'chat:70%,summarize:30%'`: each request is of one class, drawn by its share
    from the seed (the same in every run), and made to that class's lengths."""

    classes: list[RequestClass]
    shares: list[float]
    """Each class's share, in `classes`' order; they add up to 1."""

    def pick(self, seed: int, number: int) -> RequestClass:
        u = random.Random(seed * 1_000_003 + number + 0xC1A55).random()
        for cls, share in zip(self.classes, self.shares, strict=True):
            if u < share:
                return cls
            u -= share
        return self.classes[-1]


class Conversation(msgspec.Struct, frozen=True):
    """`--sessions N --turns K --think-ms D`: N conversations at once, each K turns one after
    the other, D ms between a turn's end and the next one's send."""

    sessions: int
    turns: int
    think_ms: float = 0.0


class RequestShape(msgspec.Struct, frozen=True, kw_only=True):
    """How requests are made: lengths fixed, uniform in [lo, hi] or from a distribution
    (`cadence.lab.load.lengths`), prompts from a file,
    requests from a trace, or the turns of conversations.

    Request i is the same whichever process sends it and however often the run is repeated
    with the same seed.
    """

    prompt_tokens: tuple[int, int] = (16, 16)
    max_tokens: tuple[int, int] = (128, 128)
    prompts: list[tuple[list[int], int]] = []
    """(prompt token ids, max_tokens or 0 for the shape's) pairs, cycled; from a JSONL file."""
    seed: int = 0
    trace: list[TraceRow] = []
    """Request i is row i of a trace (`cadence.lab.load.trace`), sent at its time."""
    block_tokens: int = BLOCK_TOKENS
    """Tokens per hash block of the trace."""
    conversation: Conversation | None = None
    """Request i is turn i % turns of session i // turns: its history and a new message."""
    session_header: str = ""
    """The header that carries a request's session id (trace sessions, conversations)."""
    prompt_lengths: Lengths | None = None
    """A distribution of prompt lengths, in place of `prompt_tokens`' uniform range."""
    output_lengths: Lengths | None = None
    """A distribution of max_tokens, in place of `max_tokens`' uniform range."""
    clients: ClientMix | None = None
    """Populations of clients that behave apart (slow readers, cancels, deadlines)."""
    mix: ClassMix | None = None
    """Request classes with lengths of their own (`--mix`), in place of the shape's."""

    def prompt_length(self, rng: random.Random) -> int:
        return _draw(self.prompt_lengths, self.prompt_tokens, rng)

    def output_length(self, rng: random.Random) -> int:
        return _draw(self.output_lengths, self.max_tokens, rng)

    def request(self, i: int) -> RequestPlan:
        plan = self._request(i)
        return plan if self.clients is None else self.clients.place(plan, self.seed)

    def _request(self, i: int) -> RequestPlan:
        if self.trace:
            row = self.trace[i]
            return RequestPlan(
                f"bench-{i}",
                _prompts(self.seed, self.block_tokens).prompt(row, i),
                row.output_length,
                i,
                row.turn,
                headers=self._session(row.session),
            )
        if self.conversation is not None:
            return self._turn(i, self.conversation)
        rng = random.Random(self.seed * 1_000_003 + i)
        if self.mix is not None:
            cls = self.mix.pick(self.seed, i)
            length, max_tokens = cls.lengths(rng)
            prompt = [rng.randrange(32, 127) for _ in range(length)]
            return RequestPlan(f"bench-{i}", prompt, max_tokens, i, request_class=cls.name)
        max_tokens = self.output_length(rng)
        if self.prompts:
            prompt, fixed = self.prompts[i % len(self.prompts)]
            return RequestPlan(f"bench-{i}", prompt, fixed or max_tokens, i)
        prompt = [rng.randrange(32, 127) for _ in range(self.prompt_length(rng))]
        return RequestPlan(f"bench-{i}", prompt, max_tokens, i)

    def _session(self, session: str) -> list[tuple[str, str]]:
        return [(self.session_header, session)] if self.session_header and session else []

    def _turn(self, i: int, conversation: Conversation) -> RequestPlan:
        """Turn t of session s: every earlier turn's user message and a stand-in of its
        answer (as long as its max_tokens, the same in every run), then the new message."""
        session, turn = divmod(i, conversation.turns)
        prompt, parts = bytearray(), []
        for k in range(turn + 1):
            rng = random.Random((self.seed * 1_000_003 + session) * 1_000_003 + k)
            user = printable(rng, self.prompt_length(rng))
            max_tokens = self.output_length(rng)
            prompt += user
            parts.append(len(user))
            if k < turn:
                answer = printable(rng, max_tokens)
                prompt += answer
                parts.append(len(answer))
        return RequestPlan(
            f"bench-{i}",
            list(prompt),
            max_tokens,
            i,
            turn + 1,
            parts,
            self._session(f"session-{session}"),
        )


@functools.lru_cache(maxsize=4)
def _prompts(seed: int, block_tokens: int) -> Prompts:
    """The process's prompt builder of a trace (it keeps the blocks it made)."""
    return Prompts(seed, block_tokens)


def poisson_offsets(rate: float, seed: int, stages: Sequence[tuple[float, float, float]] = ()):
    """Arrival times (seconds from the start) of a Poisson process: exponential gaps. With
    `stages`, (rate at its start, rate at its end, seconds) each, the rate follows them (a
    ramp when the two differ, a step when they do not) and the arrivals end with the last
    stage (`math.inf` seconds: it holds); the same unit-rate draws are stretched onto the
    rate's curve (time rescaling), so a seed gives the same run whatever its stages."""
    rng = random.Random(seed)
    if not stages:
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            yield t
    start, mass = 0.0, 0.0
    """The current stage's start time and the unit-rate time spent before it."""
    remaining = iter(stages)
    r0, r1, length = next(remaining)
    need = rng.expovariate(1.0)
    while True:
        within = _stage_time(r0, r1, length, need - mass)
        if within is not None:
            yield start + within
            need += rng.expovariate(1.0)
            continue
        mass += (r0 + r1) / 2 * length
        start += length
        try:
            r0, r1, length = next(remaining)
        except StopIteration:
            return


def _stage_time(r0: float, r1: float, length: float, m: float) -> float | None:
    """The time into a stage (rate r0 to r1 linearly over `length` s) by which the rate's
    integral reaches `m`; None when the stage ends first."""
    if r1 == r0:
        t = m / r0 if r0 > 0 else math.inf
    else:
        a = (r1 - r0) / (2 * length)
        t = (
            (-r0 + math.sqrt(r0 * r0 + 4 * a * m)) / (2 * a)
            if r0 * r0 + 4 * a * m >= 0
            else math.inf
        )
    return t if t <= length else None

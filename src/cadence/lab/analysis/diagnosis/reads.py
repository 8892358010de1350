"""Each stream's outputs as the client read them, and the gaps between reads: the ground the
coincidence rules stand on, from client timestamps alone, whatever the protocol.

A *read* is what one stream received at one instant: outputs of one stream that arrived less
than `TOGETHER_MS` apart came in one network read or one batch of messages (the drivers
stamp each output as it is taken from the connection, so outputs that were already buffered
are stamped microseconds apart: SSE events written at once, gRPC messages in one HTTP/2
read). A read of k tokens is k outputs held back and sent together.

The yardstick is the run's typical time per token, `typical_ms`: the median over every gap
between reads of the gap divided by the tokens of the read that ends it. A server that holds
five tokens and sends them at once still makes a token per step, and a stream whose tokens
come in pairs is not slower for it.

A gap is *slow* when it exceeds `SLOW_GAP_RATIO` typical gaps plus `SLOW_GAP_MS`; what it
takes beyond one typical gap is its *excess*, the tail time the rules attribute to causes.
A first output is slow past `SLOW_FIRST_GAPS` typical gaps and `SLOW_FIRST_MS` more than
one; its excess is what it took beyond one typical gap.
"""

from __future__ import annotations

import bisect
import statistics

from cadence.lab.percentile import percentile
from cadence.lab.records import RequestRecord

NS_PER_MS = 1e6

TOGETHER_MS = 1.0
TOGETHER_SHARE = 0.2
"""Outputs of one stream less than this many ms apart, and less than this share of the run's
typical gap between them, came in one read. A client with 32 streams on one busy core takes
0.1-0.5 ms between two buffered messages of a stream; a step is rarely under 3 ms."""

SLOW_GAP_RATIO = 1.5
SLOW_GAP_MS = 5.0
"""A gap between reads is slow above this many typical gaps plus this many ms (the same
bound as a healthy ITL p99)."""

SLOW_FIRST_GAPS = 5.0
SLOW_FIRST_MS = 100.0
"""A first output is slow after this many typical gaps and this many ms more than one:
opening a burst of 16-64 streams costs the client and the front up to 100 ms on a busy
2-core host, whatever the server (as `ttft.TTFT_HIGH_MIN_MS`)."""

MIN_GAPS = 20
"""Fewer gaps between reads than this are no run to read coincidences from."""


class StreamReads:
    """One successful stream, read by read."""

    __slots__ = (
        "end_ns",
        "handoff_read",
        "number",
        "per_token_ms",
        "prefilled_ms",
        "prompt_tokens",
        "record",
        "start_ns",
        "step_ends",
        "step_waits",
        "times",
        "tokens",
        "worker",
    )

    def __init__(self, number: int, record: RequestRecord, together_ns: float) -> None:
        self.number = number
        self.record = record
        self.start_ns = record.start_ns
        self.end_ns = record.arrival_ns[-1]
        self.prompt_tokens = record.prompt_tokens
        self.worker = record.worker
        self.times: list[int] = []
        """Each read's arrival (its first output's stamp)."""
        self.tokens: list[int] = []
        """Tokens in each read."""
        ends = record.t_step_end_ns if len(record.t_step_end_ns) == len(record.arrival_ns) else ()
        self.step_ends: list[int] = []
        """With the server's timing (cadence): when the engine's step that made each read's
        last output ended, on the server's clock; empty without it."""
        waits = (
            record.t_step_cpu_wait_ns
            if ends and len(record.t_step_cpu_wait_ns) == len(ends)
            else ()
        )
        self.step_waits: list[float] = []
        """With cadence's per-step wait for a CPU (`t_step_cpu_wait_ns`): how long the engine's
        threads waited for one in the steps of each read's outputs, added up (ms), from the
        step after the previous read's to the read's own; -1 where none of its outputs carried
        it. Empty without it."""
        self.handoff_read = 0
        """Disaggregated serving (with the timing): the read that holds the decode worker's
        first output, after the hand-off; 0: none (not handed off, or that output came in
        the first read with the prefill worker's)."""
        self.prefilled_ms = 0.0
        """...and the first output's time on the server, from the front's receiving the
        request to the end of its prefill worker's step; 0: not prefilled on one."""
        decode = record.worker
        made_by = record.chunk_workers() if record.prefill_worker >= 0 else ()
        if made_by and record.t_received_ns and ends:
            self.prefilled_ms = max(0.0, (ends[0] - record.t_received_ns) / NS_PER_MS)
        last = None
        for k, (at, n) in enumerate(zip(record.arrival_ns, record.tokens, strict=False)):
            wait = waits[k] / NS_PER_MS if waits and waits[k] >= 0 else -1.0
            if last is not None and at - last < together_ns:
                self.tokens[-1] += n
                if ends:
                    self.step_ends[-1] = ends[k]
                if waits and wait >= 0:
                    self.step_waits[-1] = max(self.step_waits[-1], 0.0) + wait
            else:
                self.times.append(at)
                self.tokens.append(n)
                if ends:
                    self.step_ends.append(ends[k])
                if waits:
                    self.step_waits.append(wait)
            if not self.handoff_read and k < len(made_by) and made_by[k] == decode:
                self.handoff_read = len(self.times) - 1
            last = at
        self.per_token_ms = [
            (self.times[j] - self.times[j - 1]) / NS_PER_MS / self.tokens[j]
            for j in range(1, len(self.times))
            if self.tokens[j]
        ]
        """Each gap divided by the tokens of the read that ends it."""

    @property
    def process(self) -> int:
        """The load process that read it (`client.loop_stalls` are per process)."""
        return self.record.process

    @property
    def speed_ms(self) -> float | None:
        """The stream's median time per token: tokens that came in pairs do not make it
        slower, a stall now and then does not move it."""
        return statistics.median(self.per_token_ms) if self.per_token_ms else None

    @property
    def first_ns(self) -> int:
        return self.times[0]

    @property
    def ttft_ms(self) -> float:
        return (self.times[0] - self.start_ns) / NS_PER_MS


class Gap:
    """The time between two reads of one stream."""

    __slots__ = ("excess_ms", "ms", "read", "stream", "t0", "t1", "tokens")

    def __init__(self, stream: StreamReads, read: int, typical_ms: float) -> None:
        self.stream = stream
        self.read = read
        """The read that ends the gap (1 or more)."""
        self.t0 = stream.times[read - 1]
        self.t1 = stream.times[read]
        self.tokens = stream.tokens[read]
        self.ms = (self.t1 - self.t0) / NS_PER_MS
        self.excess_ms = self.ms - typical_ms


class Reads:
    """Every successful stream's reads, the run's typical gap, its slow gaps and slow first
    outputs, and the instants the rules compare them with."""

    def __init__(self, records: list[RequestRecord]) -> None:
        ok = [r for r in records if r.code == "OK" and r.arrival_ns and sum(r.tokens)]
        raw = [
            (b - a) / NS_PER_MS / n
            for r in ok
            for a, b, n in zip(r.arrival_ns, r.arrival_ns[1:], r.tokens[1:], strict=False)
            if n and b - a >= TOGETHER_MS * NS_PER_MS
        ]
        spaced = percentile(sorted(raw), 50) if raw else 0.0
        together_ns = min(TOGETHER_MS, TOGETHER_SHARE * spaced) * NS_PER_MS
        self.together_ms = together_ns / NS_PER_MS
        self.streams = [StreamReads(k, r, together_ns) for k, r in enumerate(ok)]
        per_token = [v for s in self.streams for v in s.per_token_ms]
        self.typical_ms = statistics.median(per_token) if per_token else 0.0

        typical = self.typical_ms
        self.gaps = [Gap(s, j, typical) for s in self.streams for j in range(1, len(s.times))]
        self.slow_gap_ms = SLOW_GAP_RATIO * typical + SLOW_GAP_MS
        self.slow = [g for g in self.gaps if g.ms > self.slow_gap_ms]
        self.slow_first_ms = max(SLOW_FIRST_GAPS * typical, typical + SLOW_FIRST_MS)
        self.slow_firsts = [s for s in self.streams if s.ttft_ms > self.slow_first_ms]
        self.firsts = sorted(s.first_ns for s in self.streams)
        self._joins = sorted((s.first_ns, s.prompt_tokens, s.number) for s in self.streams)
        self.ends = sorted(s.end_ns for s in self.streams)
        merged = sorted((t, s.number) for s in self.streams for t in s.times)
        self.merged = [t for t, _ in merged]
        """Every read of every stream, in time order."""
        self._merged_streams = [n for _, n in merged]

    @property
    def usable(self) -> bool:
        return len(self.streams) >= 2 and len(self.gaps) >= MIN_GAPS and self.typical_ms > 0

    def itl_excess_ms(self) -> float:
        """The tail time of the gaps: every slow gap's excess, added up."""
        return sum(g.excess_ms for g in self.slow)

    def ttft_excess_ms(self) -> float:
        """The tail time of the first outputs: every slow one's excess, added up."""
        return sum(s.ttft_ms - self.typical_ms for s in self.slow_firsts)

    def firsts_near(self, t_ns: int, window_ns: float) -> int:
        """First outputs of any stream within `window_ns` of `t_ns`."""
        return bisect.bisect_right(self.firsts, t_ns + window_ns) - bisect.bisect_left(
            self.firsts, t_ns - window_ns
        )

    def joined_at(self, t_ns: int, window_ns: float, stream: int) -> tuple[int, int]:
        """(streams, their prompt tokens) whose first output came within `window_ns` of
        `t_ns`, `stream` left out: the streams that joined at that instant."""
        lo = bisect.bisect_left(self._joins, (t_ns - window_ns,))
        n = tokens = 0
        for first, prompt, number in self._joins[lo:]:
            if first > t_ns + window_ns:
                break
            if number != stream:
                n += 1
                tokens += prompt
        return n, tokens

    def ends_between(self, t0_ns: float, t1_ns: float) -> int:
        """Streams whose last output came in [t0, t1]."""
        return bisect.bisect_right(self.ends, t1_ns) - bisect.bisect_left(self.ends, t0_ns)

    def open_at(self, t_ns: int) -> int:
        """Streams receiving at `t_ns`: their first output seen, their last not yet."""
        return bisect.bisect_right(self.firsts, t_ns) - bisect.bisect_left(self.ends, t_ns)

    def others_inside(self, t0_ns: int, t1_ns: int, stream: int) -> list[int]:
        """Every other stream's reads strictly inside (t0, t1), in time order."""
        lo = bisect.bisect_right(self.merged, t0_ns)
        hi = bisect.bisect_left(self.merged, t1_ns)
        return [self.merged[k] for k in range(lo, hi) if self._merged_streams[k] != stream]

    def silence_ms(self, t0_ns: int, t1_ns: int, stream: int) -> float:
        """The longest stretch inside (t0, t1) in which no other stream got anything."""
        lo = bisect.bisect_left(self.merged, t0_ns)
        hi = bisect.bisect_right(self.merged, t1_ns)
        last, longest = t0_ns, 0
        for k in range(lo, hi):
            if self._merged_streams[k] == stream:
                continue
            t = self.merged[k]
            longest = max(longest, t - last)
            last = t
        return max(longest, t1_ns - last) / NS_PER_MS

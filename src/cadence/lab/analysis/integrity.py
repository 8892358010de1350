"""Output integrity counted from positions: tokens lost, repeated or out of order, and streams
that ended short.

Each chunk carries its first token's position in the stream (`index`: the server's own number
where the protocol has one, else the client's count) and how many tokens it holds, so it
covers the positions [index, index + tokens). Per stream:

- repeated_tokens: positions covered a second (third...) time;
- lost_tokens: positions below the stream's end that no chunk covered; the end is the furthest
  position any chunk reached (an empty final chunk's index counts), or max_tokens when the
  stream ended OK for its length;
- reordered_chunks: the fewest chunks that, moved, put the others in order: the chunks with
  something new to say (a chunk that only repeats is a repeat, not a reorder) less the longest
  run of them, in arrival order, whose positions never go down. Two neighbours swapped is one;
- short_streams: streams that ended OK without a final chunk, or with a length finish and an
  end other than max_tokens.

So a swap is a reorder and nothing else, a gap is lost tokens and nothing else, and a repeat
is repeated tokens and nothing else: each fault is counted once, under its own name.

Over OpenAI (SSE), a server whose events carry no position of its own is numbered by the
client: each text event is one position. Its usage (`RequestRecord.usage_outputs`) is
compared with the events that arrived, never spread over them (a spread would hide a
duplicated or a missing event):

- extra_events: text events beyond the server's own count, a duplicated event most often:
  a server never sends more text events than outputs;
- usage_above_events (and usage_above_events_streams): outputs the usage counts beyond the
  events, information and not a fault: several tokens an event is how some servers stream,
  and an event missing cannot be told from it without the server's own positions (cadence's
  extension has them: a missing event there is lost tokens). The stream's end, for
  short_streams, is then the usage's count.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from cadence.lab.records import RequestRecord
from cadence.lab.results import Integrity, Workload

CHECKS = ("lost_tokens", "repeated_tokens", "reordered_chunks", "short_streams", "extra_events")
"""The integrity counts of a result, in the order they are shown."""
CHECK_WORDS = {
    "lost_tokens": "lost",
    "repeated_tokens": "repeated",
    "reordered_chunks": "reordered",
    "short_streams": "short streams",
    "extra_events": "extra events",
}
"""Each check as the summary and the findings say it."""
_POSITIONS = CHECKS[:3]
"""The checks read from each chunk's position in its stream."""
_EVENTS = CHECKS[4:]
"""The checks only an SSE stream (OpenAI) has: its text events against its usage."""

_FINISH_LENGTH = 1
"""A stream that ended because it reached max_tokens (cadence's FinishReason LENGTH)."""


def counted_checks(workload: Workload) -> tuple[str, ...]:
    """The checks the run behind `workload` counted. Any gRPC service (`--protocol grpc`)
    knows positions only from `--index-field`, and never why a stream ended, so it counts
    no short stream; every other protocol counts all."""
    if workload.protocol == "openai":
        return CHECKS
    if not workload.grpc:
        return CHECKS[:4]
    return _POSITIONS if workload.grpc.index_field else ()


def faults(integrity: Integrity, workload: Workload) -> dict[str, int]:
    """The counted checks that are not 0, by name."""
    return {name: count for name in counted_checks(workload) if (count := getattr(integrity, name))}


@dataclass
class StreamCount:
    """One stream's integrity counts (see the module docstring)."""

    lost: int = 0
    repeated: int = 0
    reordered: int = 0
    end: int = 0
    """One past the furthest position any chunk reached."""


def count_stream(index: Sequence[int], tokens: Sequence[int], until: int = 0) -> StreamCount:
    """The counts of one stream's chunks, in arrival order: chunk i holds `tokens[i]` tokens
    from position `index[i]`. `until`: positions below it are due even if no chunk reached
    them (max_tokens of a stream that finished for its length)."""
    covered = _Covered()
    count = StreamCount()
    ordered_tails: list[int] = []
    """Patience sorting: the smallest last position of an in-order run of each length."""
    new_chunks = 0
    for first, n in zip(index, tokens):
        first, n = max(0, first), max(0, n)
        count.end = max(count.end, first + n)
        if not n:
            continue
        seen = covered.add(first, first + n)
        count.repeated += seen
        if seen == n:
            continue  # nothing new: a repeat, not out of order
        new_chunks += 1
        k = bisect.bisect_right(ordered_tails, first)
        if k == len(ordered_tails):
            ordered_tails.append(first)
        else:
            ordered_tails[k] = first
    count.reordered = new_chunks - len(ordered_tails)
    count.lost = max(count.end, until) - covered.total
    return count


class _Covered:
    """Disjoint covered intervals [start, end), sorted; a chunk in order extends the last one,
    so a stream costs O(chunks) whatever its token counts."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.total = 0

    def add(self, a: int, b: int) -> int:
        """Cover [a, b); return how much of it was covered already."""
        starts, ends = self.starts, self.ends
        if ends and a >= ends[-1]:  # the common case: at or after everything so far
            if a == ends[-1]:
                ends[-1] = b
            else:
                starts.append(a)
                ends.append(b)
            self.total += b - a
            return 0
        i = bisect.bisect_left(ends, a)  # the first interval that ends at or after a
        j = bisect.bisect_right(starts, b)  # past the last that starts at or before b
        seen = sum(max(0, min(b, ends[k]) - max(a, starts[k])) for k in range(i, j))
        self.total += (b - a) - seen
        if i < j:
            a, b = min(a, starts[i]), max(b, ends[j - 1])
        starts[i:j] = [a]
        ends[i:j] = [b]
        return seen


def events_against_usage(events: int, usage: int) -> tuple[int, int]:
    """An SSE stream's text events against its usage's count of outputs: (extra events, the
    outputs usage counts beyond the events). See the module docstring."""
    return max(0, events - usage), max(0, usage - events)


def check_integrity(records: list[RequestRecord]) -> Integrity:
    """The run's integrity counts, over every stream (those that failed too: what they did
    receive must still be whole and in order)."""
    result = Integrity()
    for r in records:
        finished_for_length = r.code == "OK" and r.finish_reason == _FINISH_LENGTH
        usage = r.usage_outputs
        # Numbered by the client, a stream's end is the server's count where it gives one.
        until = r.max_tokens if finished_for_length and usage < 0 else 0
        count = count_stream(r.index, r.tokens, until)
        result.lost_tokens += count.lost
        result.repeated_tokens += count.repeated
        result.reordered_chunks += count.reordered
        end = count.end
        if usage >= 0:
            extra, above = events_against_usage(len(r.tokens), usage)
            result.extra_events += extra
            result.usage_above_events += above
            result.usage_above_events_streams += bool(above)
            end = usage
        if r.code == "OK" and (
            r.finish_reason == 0 or (finished_for_length and end != r.max_tokens)
        ):
            result.short_streams += 1
    return result

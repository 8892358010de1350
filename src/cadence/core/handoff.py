"""Disaggregated serving, the front's part: moving a sequence from the prefill worker that
gave its first token to a decode worker that streams the rest.

A prefill worker sends each sequence's state up its output socket (`StateExport`, after the
step that carried the first token) and holds nothing more of it. The front, which owns the
request (its cancellation, deadline and drain, and which workers are alive), picks a decode
worker by load and sends it the request again with the state (`StateImport`). At most
`--handoff-window` states go to one decode worker ahead of its taking them into its batch
(its `StepOutput.imported` says when); the rest wait here, in arrival order, so a decode
worker without room is never sent more than the window. A request that ends at any point
(cancelled, past its deadline, drained, its worker dead) leaves nothing behind: a state
waiting here is dropped, one in flight is aborted in the decode worker like any sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

from cadence.core.stream import RequestStream
from cadence.router.worker_router import NoWorkerAvailable, WorkerRouter
from cadence.transport.front_channel import WorkerLink
from cadence.transport.messages import StateExport, StateImport
from cadence.vocabulary import Failure


class HandOffs:
    """The front's sequences between a prefill worker and a decode worker."""

    def __init__(
        self,
        links: list[WorkerLink],
        router: WorkerRouter,
        streams: dict[int, RequestStream],
        prefill: range,
        decode: range,
        window: int,
    ) -> None:
        self._links = links
        self._router = router
        self._streams = streams
        self.prefill = prefill
        """The prefill workers' indices."""
        self.decode = decode
        """The decode workers' indices."""
        self._window = window
        self._requests: dict[int, tuple[msgspec.Raw, int]] = {}
        """Each sequence sent to a prefill worker: its encoded request and max_tokens, until
        it is handed off or ends."""
        self._queued: list[deque[tuple[int, StateImport]]] = [deque() for _ in links]
        """States for each decode worker beyond its window, oldest first."""
        self._in_flight: dict[int, int] = {}
        """Sequences sent to a decode worker and not yet in its batch, by their worker."""
        self._sent = [0] * len(links)
        """States each decode worker has been sent and not yet taken (at most the window)."""
        self.on_handoff: Callable[[], None] = lambda: None
        """Told of each hand-off (the metrics count it)."""

    def expect(self, seq_id: int, request: msgspec.Raw, max_tokens: int) -> None:
        """`seq_id` starts on a prefill worker: keep its request for its decode worker."""
        self._requests[seq_id] = (request, max_tokens)

    def arrived(self, message: StateExport, recv_ns: int) -> None:
        """A prefill worker handed a sequence over: on to the least loaded decode worker."""
        seq_id = message.seq_id
        held = self._requests.pop(seq_id, None)
        stream = self._streams.get(seq_id)
        if held is None or stream is None or stream.done:
            return  # it ended meanwhile (cancelled, failed, finished): nothing holds it now
        request, max_tokens = held
        router = self._router
        try:
            worker = router.pick(None, self.decode)
        except NoWorkerAvailable:
            stream.fail(
                Failure.UNAVAILABLE,
                "no decode worker is running to go on with this request after its first "
                "token; retry",
            )
            return
        router.release(stream.worker, max_tokens)
        router.assign(worker, max_tokens)
        stream.handed_off(worker, self._links[worker], message.worker, recv_ns)
        self.on_handoff()
        handed = StateImport(
            request,  # type: ignore[arg-type]  # Raw: the encoded AddRequest
            message.generated,
            message.tokens,
            message.state,
        )
        self._queued[worker].append((seq_id, handed))
        self._send(worker)

    def admitted(self, worker: int, seq_ids: list[int]) -> None:
        """A decode worker took these handed-over sequences into its batch."""
        in_flight = self._in_flight
        for seq_id in seq_ids:
            if in_flight.pop(seq_id, None) is not None:
                self._sent[worker] -= 1
        self._send(worker)

    def ended(self, seq_id: int, worker: int) -> None:
        """The request ended (however): forget it; a state waiting here is dropped, and one
        in flight frees its place in `worker`'s window (the worker aborts it)."""
        if self._requests.pop(seq_id, None) is not None:
            return  # still on its prefill worker, or its state on the way to the front
        if self._in_flight.pop(seq_id, None) is not None:
            self._sent[worker] -= 1
            self._send(worker)
            return
        queued = self._queued[worker]
        for entry in queued:
            if entry[0] == seq_id:
                queued.remove(entry)
                break

    def worker_down(self, worker: int) -> None:
        """A worker stopped (its streams fail apart from this): its window starts empty when
        it comes back, and nothing waits for it."""
        self._sent[worker] = 0
        self._queued[worker].clear()
        for seq_id in [s for s, w in self._in_flight.items() if w == worker]:
            del self._in_flight[seq_id]

    def in_flight(self) -> int:
        """States sent to decode workers and not yet in their batches."""
        return len(self._in_flight)

    def waiting(self) -> int:
        """States waiting in the front for room on a decode worker."""
        return sum(len(q) for q in self._queued)

    def _send(self, worker: int) -> None:
        queued, window = self._queued[worker], self._window
        link = self._links[worker]
        while queued and self._sent[worker] < window:
            seq_id, handed = queued.popleft()
            self._in_flight[seq_id] = worker
            self._sent[worker] += 1
            link.add_import(handed)

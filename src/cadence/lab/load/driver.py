"""The interface every protocol's driver implements, for one load process.

A driver is made from its target (`Target.driver()`), then: `connect` opens the process's
channels or sessions; `one` sends one planned request and keeps its chunks as raw bytes or
events, stamping only their arrival times; after the run, `decode` fills each record from
what `one` kept; `close` ends the connections. The process loop (`processes.py`) speaks only
this interface, so a new protocol adds a module, not a branch.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from cadence.credentials import ClientCredentials

if TYPE_CHECKING:
    import grpc

    from cadence.lab.load.plan import RequestPlan
    from cadence.lab.records import RequestRecord


class Session(msgspec.Struct, frozen=True, kw_only=True):
    """How a load process talks to the server: the same for each of its requests."""

    address: str
    """HOST:PORT of a gRPC server (an HTTP target carries its own URL)."""
    channels: int = 1
    """Connections (gRPC channels, HTTP sessions) the requests are spread over."""
    credentials: ClientCredentials | None = None
    include_timing: bool = True
    timeout_s: float | None = None
    read_delay_s: float = 0.0
    """Sleep this long after each chunk: a slow-reading client."""
    stall_s: float | None = None
    """End a request that gets no chunk for this long, as STALLED (recording.recording)."""

    def for_request(self, request: RequestPlan) -> tuple[float | None, float]:
        """(deadline, read delay) of `request`: its population's, else the session's."""
        return (
            request.deadline_s or self.timeout_s,
            request.read_delay_s if request.read_delay_s >= 0 else self.read_delay_s,
        )


class Driver(abc.ABC):
    """One protocol's client in one load process."""

    session: Session

    @abc.abstractmethod
    async def connect(self, session: Session) -> None:
        """Open `session.channels` connections and wait until they are ready."""

    @abc.abstractmethod
    async def one(
        self, request: RequestPlan, process: int, lane: int
    ) -> tuple[RequestRecord, list[bytes]]:
        """Send `request` on connection `lane` (modulo their number); return its record and
        the chunks kept unparsed. Never raises: an error is recorded."""

    @abc.abstractmethod
    def decode(self, record: RequestRecord, chunks: list[bytes]) -> None:
        """Fill the record's per-chunk fields from what `one` kept, in arrival order."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close what `connect` opened."""

    def prepare(self, requests: Iterable[RequestPlan]) -> None:  # noqa: B027 (optional hook)
        """Make these requests' messages now, ahead of a burst that sends them at once
        (a driver whose messages cost little to make needs nothing here)."""


class ChannelDriver(Driver):
    """A driver over gRPC channels: one stub (or method) per channel."""

    stubs: list

    async def connect(self, session: Session) -> None:
        self.session = session
        self._channels = [
            (session.credentials or ClientCredentials()).aio_channel(
                session.address, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            for _ in range(session.channels)
        ]
        for channel in self._channels:
            await asyncio.wait_for(channel.channel_ready(), 30)
        self.stubs = [self.stub(channel) for channel in self._channels]

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    @abc.abstractmethod
    def stub(self, channel: grpc.aio.Channel):
        """What `one` calls on `channel`."""

"""`net.stalled_peers`: a connection whose peer takes nothing while bytes wait is reset after
the timeout, whatever the kernel's buffers still hold; one whose peer reads, however slowly,
or that has nothing to send, is not. Real loopback sockets."""

from __future__ import annotations

import asyncio
import socket

from cadence.net.stalled_peers import StalledPeers

_TIMEOUT_S = 0.4


class _Sending(asyncio.Protocol):
    """Writes `rate` bytes every 10 ms for as long as the connection lasts (never pausing:
    what it writes piles up in the transport and the kernel, as an unread stream's would)."""

    def __init__(self, rate: int, made: asyncio.Future) -> None:
        self._rate, self._made = rate, made
        self.lost = asyncio.get_event_loop().create_future()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._made.set_result(transport)
        asyncio.get_event_loop().call_soon(self._send)

    def _send(self) -> None:
        if not self._transport.is_closing() and self._rate:
            self._transport.write(b"x" * self._rate)
            asyncio.get_event_loop().call_later(0.01, self._send)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.set_result(exc)


async def _connection(
    rate: int,
) -> tuple[socket.socket, asyncio.Transport, _Sending, asyncio.Server]:
    loop = asyncio.get_running_loop()
    made: asyncio.Future = loop.create_future()
    protocols: list[_Sending] = []

    def factory() -> _Sending:
        protocols.append(_Sending(rate, made))
        return protocols[-1]

    server = await loop.create_server(factory, "127.0.0.1", 0)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await loop.sock_connect(client, server.sockets[0].getsockname())
    transport = await made
    return client, transport, protocols[0], server


def test_a_peer_that_takes_nothing_is_reset_after_the_timeout() -> None:
    async def run() -> None:
        client, transport, protocol, server = await _connection(rate=16384)
        watch = StalledPeers(_TIMEOUT_S)
        watch.watch(transport)
        try:
            # Megabytes could still go into the kernel's buffers meanwhile; the reset comes
            # once the client's 4 KiB are full and it has acknowledged nothing for the timeout.
            await asyncio.wait_for(protocol.lost, 10)
            try:
                while client.recv(1 << 20):
                    pass
            except BlockingIOError:
                raise AssertionError("the connection was closed, not reset") from None
            except ConnectionResetError:
                pass
        finally:
            watch.close()
            client.close()
            server.close()

    asyncio.run(run())


def test_a_peer_that_reads_or_has_nothing_waiting_is_not_reset() -> None:
    async def run() -> None:
        slow, slow_transport, _, slow_server = await _connection(rate=2048)
        idle, idle_transport, _, idle_server = await _connection(rate=0)
        watch = StalledPeers(_TIMEOUT_S)
        watch.watch(slow_transport)
        watch.watch(idle_transport)
        try:
            for _ in range(
                20
            ):  # 1 s, several timeouts: the slow one reads 4 KiB each time, less than it is sent
                await asyncio.sleep(0.05)
                try:
                    slow.recv(4096)
                except BlockingIOError:
                    pass
            assert not slow_transport.is_closing() and not idle_transport.is_closing()
        finally:
            watch.close()
            for sock in (slow, idle):
                sock.close()
            slow_server.close()
            idle_server.close()

    asyncio.run(run())

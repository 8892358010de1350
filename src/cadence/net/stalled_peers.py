"""Connections whose peer takes nothing: `--stall-timeout` below the kernel's buffers.

A write to a TCP socket completes once the kernel has the bytes, and the kernel holds
megabytes per socket (4 MB on loopback), so a server whose writes wait for a client that reads
nothing waits for minutes at a few kilobytes a second before it notices. Here the kernel is
asked instead: a connection that has bytes queued (`SIOCOUTQ`) while its peer has acknowledged
none of them (`tcp_info.tcpi_bytes_acked`) for the whole timeout is reset, whatever the
buffers still hold. Once the peer's own receive buffer is full it acknowledges nothing, so
that buffer is the only one a client that stopped reading still gets filled.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios

log = logging.getLogger("cadence.http")

_OUTQ = termios.TIOCOUTQ
"""SIOCOUTQ: bytes in a TCP socket's send queue, sent but not acknowledged or not yet sent."""
_ACKED = slice(120, 128)
"""`tcpi_bytes_acked` (Linux 4.1+) in `struct tcp_info`: bytes the peer acknowledged, ever."""
_INFO_BYTES = 128
_RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on, 0 s: the close is a reset, and the kernel drops what it still holds."""
_LOOK_S = 0.5
"""The most time between two looks at a connection: a cut comes at most this late."""


def _queued(sock: socket.socket) -> int:
    buf = bytearray(4)
    fcntl.ioctl(sock.fileno(), _OUTQ, buf)
    return int.from_bytes(buf, "little")


def _acked(sock: socket.socket) -> int | None:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_BYTES)
    return int.from_bytes(info[_ACKED], "little") if len(info) >= _ACKED.stop else None


class StalledPeers:
    """Resets the watched connections whose peer took nothing for `timeout_s` while bytes
    waited for it; `watch` each connection once it is made."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._watched: dict[asyncio.Transport, list] = {}
        """transport -> [its socket, bytes acknowledged at the last look, since when]"""
        self._task: asyncio.Task | None = None

    def watch(self, transport: asyncio.Transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        loop = asyncio.get_running_loop()
        self._watched[transport] = [sock, -1, loop.time()]
        if self._task is None:
            self._task = loop.create_task(self._sweep())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._watched.clear()

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(_LOOK_S, self._timeout_s / 4))
            now = loop.time()
            for transport, seen in list(self._watched.items()):
                if transport.is_closing():
                    del self._watched[transport]
                    continue
                sock = seen[0]
                try:
                    acked = _acked(sock) if _queued(sock) else None
                except OSError:  # closed under us
                    del self._watched[transport]
                    continue
                if acked is None or acked != seen[1]:  # nothing waits, or the peer took some
                    seen[1], seen[2] = acked, now
                elif now - seen[2] >= self._timeout_s:
                    del self._watched[transport]
                    log.debug(
                        "reset a connection whose client took nothing for %g s", self._timeout_s
                    )
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                    transport.abort()

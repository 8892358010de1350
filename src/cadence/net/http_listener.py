"""The HTTP port's listening sockets, accepted on the front's own loop.

uvloop's servers (libuv 1.45 and later) accept one connection per loop iteration and leave
the next to the next iteration. While the front streams to many clients an iteration lasts
tens of milliseconds, so a burst of new streams (HTTP/1.1 opens one connection per stream)
waits in the kernel's accept queue for seconds with its requests unread, however large the
backlog. Here every wake-up of a listening socket accepts all the connections queued on it,
as asyncio's own selector loop does, and hands each to the loop as an accepted socket. With
`stall_timeout_s` its connections are watched for a client that takes nothing (see
stalled_peers).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable

from cadence.net.stalled_peers import StalledPeers

log = logging.getLogger("cadence.http")

_ACCEPT_RETRY_S = 1.0
"""After accept() fails for want of something (file descriptors, memory), how long the port
rests before accepting again; the queued connections wait in the kernel meanwhile."""


class Listener:
    """Listening sockets for `protocol_factory`'s connections, on the running loop."""

    def __init__(
        self,
        protocol_factory: Callable[[], asyncio.Protocol],
        *,
        ssl_context: ssl.SSLContext | None,
        backlog: int,
        stall_timeout_s: float | None = None,
    ) -> None:
        self._factory = protocol_factory
        self._stalled = StalledPeers(stall_timeout_s) if stall_timeout_s else None
        self._ssl = ssl_context
        self._backlog = backlog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sockets: list[socket.socket] = []
        self._starting: set[asyncio.Task] = set()
        """Connections being handed to the loop (a TLS handshake lasts a round trip or more)."""

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._sockets)

    async def open(self, host: str, port: int, *, reuse_port: bool) -> int:
        """Bind every address of `host` (one port for all, when `port` is 0), listen and
        accept; return the bound port. Raises OSError (nothing left open) when one fails."""
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host or None,
            port,
            family=socket.AF_UNSPEC,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], port, *address[2:]))
                port = sock.getsockname()[1]
                sock.listen(self._backlog)
                sock.setblocking(False)
        except OSError:
            self.close()
            raise
        for sock in self._sockets:
            loop.add_reader(sock.fileno(), self._accept, sock)
        return port

    def close(self) -> None:
        """Stop accepting and close the listening sockets (connections already started stay
        open; those still in their TLS handshake are dropped)."""
        for task in self._starting:
            task.cancel()
        if self._stalled is not None:
            self._stalled.close()
        for sock in self._sockets:
            if self._loop is not None and sock.fileno() != -1:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets.clear()

    def _accept(self, sock: socket.socket) -> None:
        loop = self._loop
        assert loop is not None
        for _ in range(self._backlog):  # bounded: a flood of connects cannot hold the loop
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                log.warning(
                    "accepting HTTP connections paused for %.0f s: %s",
                    _ACCEPT_RETRY_S,
                    exc.strerror or exc,
                )
                loop.remove_reader(sock.fileno())
                loop.call_later(_ACCEPT_RETRY_S, self._resume, sock)
                return
            conn.setblocking(False)
            task = loop.create_task(self._start(conn))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    def _resume(self, sock: socket.socket) -> None:
        if sock in self._sockets and self._loop is not None:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    async def _start(self, conn: socket.socket) -> None:
        loop = self._loop
        assert loop is not None
        try:
            transport, _ = await loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl)
            if self._stalled is not None:
                self._stalled.watch(transport)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            # A client that hung up or failed its TLS handshake; the loop closed the socket.
            log.debug("HTTP connection not started: %r", exc)

"""The HTTP/2 settings a gRPC server announces, read before a run with a real HTTP/2 client
(`h2`): the stream limit per connection, the flow-control window and the largest frame.

A server's SETTINGS frame is the first thing it sends on a connection. A concurrent-stream
limit below the streams the client opens on one connection leaves the rest waiting (or,
when the server enforces it hard, refused with RST_STREAM REFUSED_STREAM, error code 7),
which reads from outside like a server that takes new calls slowly.
"""

from __future__ import annotations

import socket
import ssl

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from cadence.credentials import ClientCredentials
from cadence.lab.results import Http2Settings


def read_settings(
    target: str, credentials: ClientCredentials | None = None, timeout_s: float = 3.0
) -> Http2Settings:
    """Connect to `target` (host:port), speak HTTP/2's preface and read the server's first
    SETTINGS frame; the fields it left out are HTTP/2's defaults (the server did not limit
    them). A server that cannot be read gets `error` instead: the run goes on without."""
    credentials = credentials or ClientCredentials()
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
            sock = _tls(raw, host, credentials) if credentials.secure else raw
            return _settings(sock, credentials.secure)
    except (OSError, ValueError, h2.exceptions.ProtocolError) as exc:
        return Http2Settings(tls=credentials.secure, error=f"{type(exc).__name__}: {exc}")


def _tls(raw: socket.socket, host: str, credentials: ClientCredentials) -> ssl.SSLSocket:
    context = ssl.create_default_context(
        cadata=credentials.root_ca.decode() if credentials.root_ca else None
    )
    context.set_alpn_protocols(["h2"])
    if (
        credentials.cert_chain is not None and credentials.private_key is not None
    ):  # both or neither
        # ssl loads a client certificate from files only; the credentials hold bytes.
        import tempfile

        with tempfile.NamedTemporaryFile("wb") as cert, tempfile.NamedTemporaryFile("wb") as key:
            cert.write(credentials.cert_chain)
            key.write(credentials.private_key)
            cert.flush()
            key.flush()
            context.load_cert_chain(cert.name, key.name)
    return context.wrap_socket(raw, server_hostname=host)


def _settings(sock: socket.socket, tls: bool) -> Http2Settings:
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    sock.sendall(connection.data_to_send())
    while True:
        data = sock.recv(65536)
        if not data:
            return Http2Settings(
                tls=tls,
                error="the server closed the connection before its "
                "SETTINGS (not HTTP/2, or TLS expected)",
            )
        for event in connection.receive_data(data):
            if isinstance(event, h2.events.RemoteSettingsChanged):
                return _announced(event.changed_settings, tls)


def _announced(changed: dict, tls: bool) -> Http2Settings:
    """The settings the server's SETTINGS frame carried; the rest stay null (HTTP/2's
    defaults)."""
    codes = h2.settings.SettingCodes

    def value(code: h2.settings.SettingCodes) -> int | None:
        return changed[code].new_value if code in changed else None

    return Http2Settings(
        tls=tls,
        max_concurrent_streams=value(codes.MAX_CONCURRENT_STREAMS),
        initial_window_size=value(codes.INITIAL_WINDOW_SIZE),
        max_frame_size=value(codes.MAX_FRAME_SIZE),
        max_header_list_size=value(codes.MAX_HEADER_LIST_SIZE),
    )

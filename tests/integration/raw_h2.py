"""gRPC calls written by hand over HTTP/2, so that their headers and bodies can be what no gRPC
client sends: a `-bin` header that is not base64, an empty or truncated body."""

from __future__ import annotations

import contextlib
import socket

import h2.config
import h2.connection
import h2.events


def framed(request: object) -> bytes:
    """`request` as one length-prefixed gRPC message."""
    data = request.SerializeToString()
    return b"\0" + len(data).to_bytes(4, "big") + data


def h2_call(
    target: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes, timeout: float = 5.0
) -> dict[bytes, bytes]:
    """One call: the response's headers and trailers in one dict ({b"reset": code} for a
    reset stream), or {} when the stream got no end within `timeout`."""
    host, port = target.rsplit(":", 1)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
    connection.initiate_connection()
    stream = connection.get_next_available_stream_id()
    connection.send_headers(
        stream,
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", target.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *headers,
        ],
    )
    connection.send_data(stream, body, end_stream=True)
    got: dict[bytes, bytes] = {}
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(connection.data_to_send())
        with contextlib.suppress(TimeoutError):
            while data := sock.recv(65536):
                for event in connection.receive_data(data):
                    if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                        got.update(event.headers)
                    elif isinstance(event, h2.events.DataReceived):
                        connection.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    elif isinstance(event, h2.events.StreamEnded):
                        return got
                    elif isinstance(event, h2.events.StreamReset):
                        return {b"reset": b"%d" % event.error_code}
                sock.sendall(connection.data_to_send())
    return {}

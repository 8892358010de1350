"""A client's credentials: the CA it trusts, its own certificate, a bearer token.

`ClientCredentials` holds file contents, not paths, so it travels as-is to the load
processes of `cadence bench` (a msgspec Struct inside their plan). Its `channel` /
`aio_channel` open a gRPC channel with them; empty credentials give the plain insecure
channel every client used before, so nothing changes for a server without security.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import grpc
import msgspec

from cadence.api.security import parse_tokens  # the server's file format, one for both

ChannelOptions = Sequence[tuple[str, Any]]


class ClientCredentials(msgspec.Struct, frozen=True, kw_only=True):
    """What a client presents to a cadence server; every field is optional."""

    root_ca: bytes | None = None
    """PEM certificates of the CA that signed the server's certificate (TLS)."""
    cert_chain: bytes | None = None
    """PEM certificate chain of the client, for a server with --tls-client-ca (mutual TLS)."""
    private_key: bytes | None = None
    """PEM private key of `cert_chain`."""
    token: str | None = None
    """Bearer token, sent as `authorization: Bearer <token>` on every call."""
    tls: bool = False
    """Use TLS even without `root_ca` (then the system's trusted CAs check the server)."""

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and the other way round")

    @classmethod
    def from_files(
        cls,
        *,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token_file: str | None = None,
        tls: bool = False,
    ) -> ClientCredentials:
        """Read the files; ValueError with the file's name if one cannot be used."""
        token = None
        if token_file is not None:
            tokens = parse_tokens(_read(token_file, "token file").decode())
            token = tokens[0] if tokens else None
            if token is None:
                raise ValueError(f"the token file {token_file} holds no token")
        return cls(
            root_ca=_read(ca, "CA file") if ca else None,
            cert_chain=_read(cert, "certificate") if cert else None,
            private_key=_read(key, "private key") if key else None,
            token=token,
            tls=tls,
        )

    @property
    def secure(self) -> bool:
        """Whether channels use TLS."""
        return self.tls or self.root_ca is not None or self.cert_chain is not None

    def _ssl(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_ca, self.private_key, self.cert_chain)

    def channel(self, target: str, options: ChannelOptions = ()) -> grpc.Channel:
        """A blocking channel to `target` with these credentials."""
        if self.secure:
            channel = grpc.secure_channel(target, self._ssl(), options=options)
        else:
            channel = grpc.insecure_channel(target, options=options)
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, _BearerToken(self.token))

    def aio_channel(self, target: str, options: ChannelOptions = ()) -> grpc.aio.Channel:
        """An asyncio channel to `target` with these credentials.

        The token goes in by a client interceptor (one extra async layer per call, only when
        a token is set) rather than per-call metadata, so callers never pass it around, and
        it works on plaintext channels too, where gRPC refuses call credentials.
        """
        interceptors = None if self.token is None else _aio_interceptors(self.token)
        if self.secure:
            return grpc.aio.secure_channel(
                target, self._ssl(), options=options, interceptors=interceptors
            )
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The client-side security flags, shared by `cadence generate` and `cadence bench`."""
    group = parser.add_argument_group("security (for a server started with TLS or tokens)")
    group.add_argument(
        "--tls",
        action="store_true",
        help="use TLS, trusting the system's CAs (implied by --tls-ca, --tls-cert)",
    )
    group.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA certificate(s) that signed the server's certificate",
    )
    group.add_argument(
        "--tls-cert",
        default=None,
        metavar="PEM",
        help="this client's certificate, for mutual TLS (with --tls-key)",
    )
    group.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    group.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="send the first token in FILE as 'authorization: Bearer <token>'",
    )


def from_arguments(args: argparse.Namespace) -> ClientCredentials:
    """The credentials that `add_arguments` flags describe (ValueError if unusable)."""
    return ClientCredentials.from_files(
        ca=args.tls_ca,
        cert=args.tls_cert,
        key=args.tls_key,
        token_file=args.token_file,
        tls=args.tls,
    )


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _with_token(metadata: Any, header: tuple[str, str]) -> list[tuple[str, str | bytes]]:
    return [*(metadata or ()), header]


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a blocking channel, whatever the call's shape."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._header),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    """grpc.ClientCallDetails is abstract; the blocking interceptor needs a concrete one."""

    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def _aio_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call shape: a grpc.aio channel files each interceptor under the
    first shape it implements only, so one object cannot serve them all."""
    header = ("authorization", f"Bearer {token}")

    def details(call_details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return call_details._replace(
            metadata=grpc.aio.Metadata(*_with_token(call_details.metadata, header))
        )

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, client_call_details, request):
            return await continuation(details(client_call_details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, client_call_details, request):
            return await continuation(details(client_call_details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, client_call_details, requests):
            return await continuation(details(client_call_details), requests)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, client_call_details, requests):
            return await continuation(details(client_call_details), requests)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]

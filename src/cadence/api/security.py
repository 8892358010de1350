"""Who may talk to the front: TLS server credentials and the bearer-token check.

- `--tls-cert` / `--tls-key`: the gRPC port speaks TLS only; a plaintext client fails in the
  handshake.
- `--tls-client-ca`: mutual TLS. Every client must present a certificate signed by that CA;
  the TLS handshake checks it before any RPC exists, so an unknown client reaches no handler
  (health included).
- `--auth-token-file`: every RPC must carry the metadata `authorization: Bearer <token>`
  with one of the file's tokens, else it ends with UNAUTHENTICATED and a message saying what
  was missing or wrong. Works with or without TLS; without TLS the token crosses the network
  in clear text, so use it alone only on loopback. The file: one token per line, surrounding
  whitespace ignored; blank lines and lines whose first non-blank character is `#` (comments)
  are skipped; a token holds no `,` (see below).
- A call or request with more than one `authorization` value is refused (UNAUTHENTICATED,
  HTTP 401), whichever token each names: which one counts would otherwise depend on the path
  (grpc.aio hands the handler each value, Envoy joins them into one with commas, aiohttp's
  lookup takes the first). A value with a comma is several joined, as HTTP joins a repeated
  header; an RFC 6750 token never holds one, and the server refuses to start with one in
  its file.

Health (`grpc.health.v1.Health`) is open without a token, on purpose: orchestrators and
load balancers (Kubernetes gRPC probes, Envoy health checks) probe it and usually cannot
attach a token, and all it tells is SERVING / NOT_SERVING for the server and for each
`cadence.worker.N` (so, how many workers there are). Reflection is not open: it describes
the whole API, and a caller without a token learns nothing about which methods exist
(even an unknown method gets UNAUTHENTICATED, not UNIMPLEMENTED).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from cadence.config import ServerConfig

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
"""RPCs that need no token (see the module docstring for why)."""


def read_tokens(path: str) -> list[str]:
    """The accepted tokens of a token file (`parse_tokens`)."""
    with open(path, encoding="utf-8") as f:
        return parse_tokens(f.read())


def parse_tokens(text: str) -> list[str]:
    """A token file's tokens: one per line, surrounding whitespace ignored, blank lines and
    `#` comment lines skipped (the server's `--auth-token-file`, a client's `--token-file`)."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def problems(config: ServerConfig) -> list[str]:
    """What is wrong with the security files, each a sentence naming the flag; [] if none.
    Checked at start-up (ServerConfig itself reads no files; it checks which flags go together).

    Checks the files' contents with the standard `ssl` module, because gRPC reports a bad
    certificate or a key that does not match it only as "Failed to bind to address".
    """
    found = []
    for flag, path in (
        ("--tls-cert", config.tls_cert),
        ("--tls-key", config.tls_key),
        ("--tls-client-ca", config.tls_client_ca),
        ("--auth-token-file", config.auth_token_file),
    ):
        if path is not None:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                found.append(f"{flag} {path}: cannot read it ({exc.strerror})")
    if found:
        return found
    if config.tls_cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(config.tls_cert, config.tls_key)
        except (ssl.SSLError, ValueError) as exc:
            found.append(
                f"--tls-cert {config.tls_cert} / --tls-key {config.tls_key}: not a PEM "
                f"certificate chain and its matching private key ({exc})"
            )
    if config.tls_client_ca is not None:
        try:
            ssl.create_default_context(cafile=config.tls_client_ca)
        except (ssl.SSLError, ValueError) as exc:
            found.append(f"--tls-client-ca {config.tls_client_ca}: not PEM CA certificates ({exc})")
    if config.auth_token_file is not None:
        tokens = read_tokens(config.auth_token_file)
        if not tokens:
            found.append(
                f"--auth-token-file {config.auth_token_file} holds no token (one per "
                "line; blank and # lines are skipped)"
            )
        elif any("," in token for token in tokens):
            found.append(
                f"--auth-token-file {config.auth_token_file}: a token holds a ',', "
                "which no request could present alone (several authorization values "
                "arrive joined by commas)"
            )
    return found


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port, or None to serve plaintext (no `--tls-cert`)."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    with open(config.tls_cert, "rb") as f:
        chain = f.read()
    with open(config.tls_key, "rb") as f:
        key = f.read()
    client_ca = None
    if config.tls_client_ca is not None:
        with open(config.tls_client_ca, "rb") as f:
            client_ca = f.read()
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_interceptors(config: ServerConfig) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors `grpc.aio.server` gets: the token check with `--auth-token-file`."""
    if config.auth_token_file is None:
        return []
    return [BearerTokenInterceptor(read_tokens(config.auth_token_file))]


def exposure_warnings(config: ServerConfig) -> list[str]:
    """Settings that expose more than their owner may think; the server logs each at start."""
    warnings = []
    loopback = _is_loopback(config.host)
    if config.auth_token_file is not None and config.tls_cert is None and not loopback:
        warnings.append(
            f"bearer tokens will cross the network in clear text: --host "
            f"{config.host} without --tls-cert"
        )
    if config.launcher == "ray" and any("," in d for d in config.devices):
        # The front's own sockets are CURVE-encrypted; torch.distributed's are not.
        warnings.append(
            "tensor-parallel ranks on different hosts talk torch.distributed (gloo "
            "/ NCCL) with no authentication or encryption: keep the cluster's "
            "network private (--dist-ifname picks the interface)"
        )
    if config.metrics_port is not None and not loopback:
        warnings.append(f"the metrics endpoint on {config.host} has no TLS and no token")
    return warnings


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


class TokenRefusal(enum.Enum):
    """Why a presented `Authorization` value is refused; each protocol words its own message."""

    MISSING = "missing"
    MALFORMED = "malformed"
    WRONG = "wrong"
    SEVERAL = "several"
    """More than one authorization value (see the module docstring)."""


class BearerTokens:
    """The accepted tokens (`--auth-token-file`) and the one check of a presented
    `Bearer <token>` value, for gRPC's metadata and HTTP's header alike.

    Tokens are compared as SHA-256 digests with `hmac.compare_digest`, against every accepted
    token, so the time taken says nothing about how much of a guess was right or which token
    it resembled.
    """

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = [_digest(token) for token in tokens]
        if not self._digests:
            raise ValueError("BearerTokens needs at least one token")

    def check(self, values: Sequence[str | bytes]) -> TokenRefusal | None:
        """Why a call whose authorization metadata (or header) has `values` (each that it
        carries; none: absent) is refused, or None when they are one naming an accepted
        token."""
        if not values:
            return TokenRefusal.MISSING
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if len(values) > 1 or "," in value:
            return TokenRefusal.SEVERAL
        scheme, _, token = value.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return TokenRefusal.MALFORMED
        digest = _digest(token)
        accepted = False
        for known in self._digests:
            accepted |= hmac.compare_digest(known, digest)  # no early exit, see the docstring
        return None if accepted else TokenRefusal.WRONG


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets an RPC through only with `authorization: Bearer <token>` naming an accepted token
    (`BearerTokens.check`).

    Runs once per RPC, before the handler; an accepted call gets its real handler untouched,
    so streaming costs nothing more per message.
    """

    def __init__(
        self, tokens: Iterable[str], open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES
    ) -> None:
        self._tokens = BearerTokens(tokens)
        self._open_prefixes = open_prefixes
        # Built once: a refused call costs no allocation beyond gRPC's own.
        self._refusals = {
            TokenRefusal.MISSING: _refusal(
                "this server requires a bearer token: send the metadata 'authorization: "
                "Bearer <token>' (cadence generate / bench: --token-file)"
            ),
            TokenRefusal.MALFORMED: _refusal("the authorization metadata must be 'Bearer <token>'"),
            TokenRefusal.WRONG: _refusal(
                "the bearer token is not one this server accepts "
                "(see the server's --auth-token-file)"
            ),
            TokenRefusal.SEVERAL: _refusal(
                "send one authorization metadata: this call carries several"
            ),
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(self._open_prefixes):
            return await continuation(handler_call_details)
        # Every value, not the first: see the module docstring. gRPC lower-cases the keys.
        values = [
            item
            for key, item in handler_call_details.invocation_metadata or ()
            if key == "authorization"
        ]
        refusal = self._tokens.check(values)
        if refusal is not None:
            return self._refusals[refusal]
        return await continuation(handler_call_details)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _refusal(message: str) -> grpc.RpcMethodHandler:
    """A handler that ends any call with UNAUTHENTICATED, whatever the method's shape.

    Stream-stream fits every kind of call on the wire; with no deserializer the request is
    never parsed, so an unauthenticated caller cannot make the server decode anything.
    """

    async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(refuse)

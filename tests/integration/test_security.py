"""TLS, mutual TLS and bearer tokens on real `cadence serve` processes, with certificates
generated here (a CA, a server certificate for 127.0.0.1/localhost, client certificates).

Three servers in all, each started once per module: TLS + tokens, mutual TLS, and
plaintext + tokens (the client's token on a channel without TLS).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_reflection.v1alpha import reflection_pb2

from cadence.client import AsyncClient, Client
from cadence.config import EngineConfig, ServerConfig
from cadence.credentials import ClientCredentials
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.processes import ProcessPlan, run_load
from cadence.proto.v1 import inference_pb2 as pb
from tests.integration.conftest import serve_refused, start_server

TOKEN = "correct-horse-battery-staple"
COMMENT = "# the tokens of the tests"
"""The token file's first line: a comment, no token."""
_NO_WAIT = 5.0
"""Seconds a failing connection gets: a refused handshake fails fast, never near this."""


# --- certificates ------------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # EC: fast to generate, unlike RSA


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str, key, issuer: str, issuer_key, *, ca: bool = False, server: bool = False
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A second CA, trusted by nobody: its client certificate must be refused."""
    other_cert: Path
    other_key: Path
    tokens: Path

    def credentials(
        self,
        *,
        ca: Path | None = None,
        client: bool = False,
        foreign_client: bool = False,
        token: str | None = None,
    ) -> ClientCredentials:
        cert, key = (
            (self.client_cert, self.client_key)
            if client
            else (self.other_cert, self.other_key)
            if foreign_client
            else (None, None)
        )
        return ClientCredentials(
            root_ca=(ca or self.ca).read_bytes(),
            cert_chain=cert.read_bytes() if cert else None,
            private_key=key.read_bytes() if key else None,
            token=token,
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_ca_key = _key(), _key()
    ca = _certificate("cadence test CA", ca_key, "cadence test CA", ca_key, ca=True)
    other_ca = _certificate("untrusted CA", other_ca_key, "untrusted CA", other_ca_key, ca=True)
    ca_path, _ = _write(d, "ca", ca, ca_key)
    other_ca_path, _ = _write(d, "other-ca", other_ca, other_ca_key)
    server_key, client_key, other_key = _key(), _key(), _key()
    server = _write(
        d,
        "server",
        _certificate("localhost", server_key, "cadence test CA", ca_key, server=True),
        server_key,
    )
    client = _write(
        d, "client", _certificate("client", client_key, "cadence test CA", ca_key), client_key
    )
    other = _write(
        d, "other", _certificate("intruder", other_key, "untrusted CA", other_ca_key), other_key
    )
    tokens = d / "tokens"
    tokens.write_text(
        f"{COMMENT}\n\nold-token-still-valid\n  {TOKEN}  \n  # rotated out: retired-token\n\n"
    )
    return Pki(ca_path, *server, *client, other_ca_path, *other, tokens)


# --- servers -----------------------------------------------------------------------------------


def _serve(*args: str) -> Iterator[str]:
    server = start_server("--devices", "cpu:1", "--step-ms", "2", *args)
    try:
        yield server.target
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def tls_token_server(pki: Pki) -> Iterator[str]:
    """TLS and bearer tokens; no client certificates."""
    yield from _serve(
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--auth-token-file",
        str(pki.tokens),
    )


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[str]:
    """Mutual TLS; no tokens."""
    yield from _serve(
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
    )


@pytest.fixture(scope="module")
def token_server(pki: Pki) -> Iterator[str]:
    """Bearer tokens on a plaintext port (loopback only, as documented)."""
    yield from _serve("--auth-token-file", str(pki.tokens))


def _stream(target: str, credentials: ClientCredentials | None, max_tokens: int = 8) -> list:
    with Client(target, credentials=credentials) as client:
        return list(client.generate("secure", max_tokens=max_tokens, timeout=_NO_WAIT))


def _error(target: str, credentials: ClientCredentials | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        _stream(target, credentials)
    return raised.value


def _assert_whole(chunks: list, max_tokens: int = 8) -> None:
    assert sum(len(c.token_ids) for c in chunks) == max_tokens
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


# --- TLS ---------------------------------------------------------------------------------------


def test_tls_client_streams(tls_token_server: str, pki: Pki) -> None:
    _assert_whole(_stream(tls_token_server, pki.credentials(token=TOKEN)))


def test_async_tls_client_streams(tls_token_server: str, pki: Pki) -> None:
    async def run() -> list:
        async with AsyncClient(tls_token_server, credentials=pki.credentials(token=TOKEN)) as c:
            return [chunk async for chunk in c.generate("secure", max_tokens=8, timeout=_NO_WAIT)]

    _assert_whole(asyncio.run(run()))


def test_plaintext_client_fails_on_a_tls_port(tls_token_server: str) -> None:
    error = _error(tls_token_server, ClientCredentials(token=TOKEN))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_server_fails(tls_token_server: str, pki: Pki) -> None:
    error = _error(tls_token_server, pki.credentials(ca=pki.other_ca, token=TOKEN))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


# --- bearer tokens -----------------------------------------------------------------------------


def test_no_token_is_unauthenticated_with_a_clear_message(tls_token_server: str, pki: Pki) -> None:
    error = _error(tls_token_server, pki.credentials())
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "requires a bearer token" in error.details()
    assert "authorization: Bearer <token>" in error.details()


def test_wrong_token_is_unauthenticated(tls_token_server: str, pki: Pki) -> None:
    error = _error(tls_token_server, pki.credentials(token="not-" + TOKEN))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not one this server accepts" in error.details()


def test_any_token_of_the_file_is_accepted(tls_token_server: str, pki: Pki) -> None:
    _assert_whole(_stream(tls_token_server, pki.credentials(token="old-token-still-valid")))


def test_a_comment_line_of_the_token_file_is_no_token(tls_token_server: str, pki: Pki) -> None:
    for comment in (COMMENT, "# rotated out: retired-token"):
        error = _error(tls_token_server, pki.credentials(token=comment))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_call_with_two_authorization_values_is_refused(token_server: str) -> None:
    """One rule on both gRPC paths (grpc.aio passed the first value on, Envoy joined them):
    more than one authorization value is refused, whichever token each names."""
    from tests.integration.raw_h2 import framed, h2_call

    body = framed(pb.GenerateRequest(prompt="hi", max_tokens=2))
    good, bad = (b"authorization", b"Bearer " + TOKEN.encode()), (b"authorization", b"Bearer no")
    for headers in ([good, bad], [bad, good], [good, good]):
        got = h2_call(token_server, "/cadence.v1.Inference/Generate", headers, body)
        assert got.get(b"grpc-status") == b"%d" % grpc.StatusCode.UNAUTHENTICATED.value[0], got
        assert b"send one authorization metadata" in got.get(b"grpc-message", b""), got
    assert (
        h2_call(token_server, "/cadence.v1.Inference/Generate", [good], body).get(b"grpc-status")
        == b"0"
    )


@pytest.mark.parametrize("package", ["grpc.reflection.v1alpha", "grpc.reflection.v1"])
def test_health_needs_no_token_but_reflection_does(
    tls_token_server: str, pki: Pki, package: str
) -> None:
    with Client(tls_token_server, credentials=pki.credentials()) as client:
        assert client.health() == "SERVING"
        assert client.health("cadence.v1.Inference") == "SERVING"
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    for token, expected in ((None, grpc.StatusCode.UNAUTHENTICATED), (TOKEN, grpc.StatusCode.OK)):
        channel = pki.credentials(token=token).channel(tls_token_server)
        # v1 and v1alpha differ only in their package: the same messages serve both.
        info = channel.stream_stream(
            f"/{package}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        try:
            replies = list(info(iter([request]), timeout=_NO_WAIT))
            code = grpc.StatusCode.OK
            names = {s.name for s in replies[0].list_services_response.service}
            assert {"cadence.v1.Inference", f"{package}.ServerReflection"} <= names
        except grpc.RpcError as exc:
            code = exc.code()
        finally:
            channel.close()
        assert code == expected


def test_token_on_a_plaintext_port(token_server: str) -> None:
    _assert_whole(_stream(token_server, ClientCredentials(token=TOKEN)))
    assert _error(token_server, None).code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(token_server) as client:
        assert client.health() == "SERVING"


def test_generate_command_with_a_token_file(token_server: str, pki: Pki) -> None:
    command = [
        sys.executable,
        "-m",
        "cadence.cli",
        "generate",
        "hi",
        "--target",
        token_server,
        "--max-tokens",
        "5",
    ]
    ok = subprocess.run(
        [*command, "--token-file", str(pki.tokens)],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stderr
    assert len(ok.stdout.strip("\n")) == 5  # the synthetic engine's tokens are printable bytes
    refused = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0
    assert "UNAUTHENTICATED" in refused.stderr


def test_load_processes_carry_credentials(tls_token_server: str, pki: Pki) -> None:
    """The bench's load processes get the credentials through their (msgpack) plan."""
    plan = ProcessPlan(
        process=0,
        target=tls_token_server,
        requests=3,
        concurrency=3,
        shape=RequestShape(max_tokens=(6, 6)),
        credentials=pki.credentials(token=TOKEN),
    )
    [result] = run_load([plan])
    assert [r.code for r in result.records] == ["OK"] * 3
    assert all(sum(r.tokens) == 6 for r in result.records)


# --- mutual TLS --------------------------------------------------------------------------------


def test_mtls_client_without_a_certificate_fails(mtls_server: str, pki: Pki) -> None:
    assert _error(mtls_server, pki.credentials()).code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_a_foreign_certificate_fails(mtls_server: str, pki: Pki) -> None:
    error = _error(mtls_server, pki.credentials(foreign_client=True))
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_a_ca_signed_certificate_streams(mtls_server: str, pki: Pki) -> None:
    _assert_whole(_stream(mtls_server, pki.credentials(client=True)))


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tls_cert": "server_cert"}, "--tls-cert and --tls-key go together"),
        ({"tls_key": "server_key"}, "--tls-cert and --tls-key go together"),
        ({"tls_client_ca": "ca"}, "--tls-client-ca (mutual TLS) needs --tls-cert"),
    ],
)
def test_config_names_the_flags_that_go_together(pki: Pki, fields: dict, message: str) -> None:
    resolved = {k: str(getattr(pki, v)) for k, v in fields.items()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerConfig(**resolved)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tls_cert": "server_cert", "tls_key": "client_key"}, "its matching private key"),
        (
            {"tls_cert": "server_cert", "tls_key": "server_key", "tls_client_ca": "tokens"},
            "not PEM CA certificates",
        ),
        ({"auth_token_file": "missing"}, "cannot read it"),
        ({"auth_token_file": "empty"}, "holds no token"),
    ],
)
def test_serve_names_the_file_that_is_wrong(
    pki: Pki, tmp_path: Path, fields: dict, message: str
) -> None:
    """The files are read at start-up: `cadence serve` says in one line which is wrong."""
    (tmp_path / "empty").write_text("\n  \n")
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    flags = [
        arg
        for k, v in fields.items()
        for arg in ("--" + k.replace("_", "-"), str(paths.get(v) or getattr(pki, v)))
    ]
    done = serve_refused(*flags)
    assert done.returncode != 0 and message in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_client_credentials_from_files(pki: Pki, tmp_path: Path) -> None:
    credentials = ClientCredentials.from_files(ca=str(pki.ca), token_file=str(pki.tokens))
    assert credentials.secure and credentials.token == "old-token-still-valid"
    assert not ClientCredentials(token=TOKEN).secure
    with pytest.raises(ValueError, match="needs its private key"):
        ClientCredentials.from_files(cert=str(pki.client_cert))
    with pytest.raises(ValueError, match="cannot read the CA file"):
        ClientCredentials.from_files(ca=str(tmp_path / "nope"))


def test_risky_exposure_is_warned_about(pki: Pki) -> None:
    from cadence.api.security import exposure_warnings

    assert (
        exposure_warnings(
            ServerConfig(auth_token_file=str(pki.tokens), transport="tcp", metrics_port=0)
        )
        == []
    )  # all on 127.0.0.1
    warnings = exposure_warnings(
        ServerConfig(
            host="0.0.0.0", auth_token_file=str(pki.tokens), transport="tcp", metrics_port=0
        )
    )
    assert len(warnings) == 2  # the worker sockets are CURVE-encrypted: no warning
    assert "clear text" in warnings[0] and "metrics" in warnings[1]
    ray_tp = ServerConfig(
        launcher="ray",
        transport="tcp",
        devices=["cpu,cpu"],
        engine=EngineConfig(name="torch", model="tiny"),
    )
    assert "torch.distributed" in exposure_warnings(ray_tp)[0]
    assert exposure_warnings(ServerConfig(host="::1", transport="tcp")) == []


def test_the_lab_reads_http2_settings_over_tls_and_mutual_tls(
    tls_token_server: str, mtls_server: str, pki: Pki
) -> None:
    from cadence.lab.measure.http2 import read_settings

    over_tls = read_settings(tls_token_server, pki.credentials())
    assert over_tls.tls and over_tls.error is None and over_tls.initial_window_size
    mutual = read_settings(mtls_server, pki.credentials(client=True))
    assert mutual.tls and mutual.error is None and mutual.initial_window_size
    plaintext = read_settings(tls_token_server)  # HTTP/2 without TLS at a TLS port
    assert plaintext.error is not None

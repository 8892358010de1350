"""The OpenAI-compatible HTTP front from outside: the official `openai` package streaming
completions and chat, every error status, a disconnect that frees its slot, `--fronts 2`."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import msgspec
import psutil
import pytest

from cadence.lab.results import SweepResult
from tests.integration.conftest import RunningServer, start_server
from tests.integration.test_security import Pki, pki  # noqa: F401 (a fixture)

openai = pytest.importorskip("openai")

HttpServer = RunningServer
"""A server started with `http=True`: `base` is its HTTP front's URL."""


def start_http(
    *args: str, timeout: float = 60.0, context: ssl.SSLContext | None = None
) -> RunningServer:
    """`cadence serve --port 0 --http-port 0 ARGS`, returned once /health answers 200
    (`context`: the client's TLS settings for a server with --tls-cert)."""
    return start_server(*args, http=True, timeout=timeout, tls_context=context)


def _get(
    url: str, headers: dict | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, dict]:
    return _call(urllib.request.Request(url, headers=headers or {}), context)


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    return _call(
        urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
    )


def _call(
    request: urllib.request.Request, context: ssl.SSLContext | None = None
) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


@pytest.fixture(scope="module")
def http_server() -> Iterator[HttpServer]:
    server = start_server(
        "--devices", "cpu:2", "--step-ms", "5", "--served-model-name", "tiny-m", http=True
    )
    yield server
    assert server.stop() == 0


def test_the_openai_package_streams_completions_and_chat(http_server) -> None:
    client = openai.OpenAI(base_url=http_server.base + "/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny-m"]
    chunks = list(
        client.completions.create(
            model="tiny-m",
            prompt="Hello",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    whole = client.completions.create(model="tiny-m", prompt="Hello", max_tokens=12)
    assert whole.choices[0].text == text  # the synthetic engine is reproducible
    assert whole.usage.total_tokens == 17
    stream = client.chat.completions.create(
        model="tiny-m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    reply = "".join(d.content or "" for d in deltas)
    chat = client.chat.completions.create(
        model="tiny-m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
    )
    assert chat.choices[0].message.content == reply and len(reply) == 8
    assert chat.choices[0].finish_reason == "length"


async def _async_stream(base: str) -> str:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused")
    async with client:
        stream = await client.completions.create(
            model="tiny-m", prompt="Hi", max_tokens=5, stream=True, stop=["\x00never"]
        )
        return "".join([c.choices[0].text async for c in stream])


def test_async_client_and_stop_strings(http_server) -> None:
    text = asyncio.run(_async_stream(http_server.base))
    assert len(text) == 5
    stop = text[2]
    status, body = _post(
        http_server.base + "/v1/completions",
        {"model": "tiny-m", "prompt": "Hi", "max_tokens": 5, "stop": stop},
    )
    assert status == 200
    assert body["choices"][0]["text"] == text[: text.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_errors_in_openai_shape(http_server) -> None:
    base = http_server.base
    cases = [
        (
            _post(base + "/v1/completions", {"model": "tiny-m", "prompt": "Hi", "max_tokens": 0}),
            400,
            "max_tokens",
        ),
        (_post(base + "/v1/completions", {"model": "tiny-m", "prompt": "Hi", "n": 3}), 400, "n"),
        (_post(base + "/v1/chat/completions", {"model": "tiny-m"}), 400, "messages"),
        (
            _post(
                base + "/v1/completions", {"model": "tiny-m", "prompt": "x", "max_tokens": 10**6}
            ),
            400,
            "max_tokens",
        ),
        (_post(base + "/v1/completions", {"model": "other", "prompt": "Hi"}), 404, "model"),
        (_get(base + "/v1/nothing"), 404, None),
        (
            _post(
                base + "/v1/completions",
                {"model": "tiny-m", "prompt": "Hi", "max_tokens": 500, "cadence_timeout_s": 0.05},
            ),
            504,
            None,
        ),
    ]
    for (status, body), expected, param in cases:
        assert status == expected, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["param"] == param and body["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=base + "/v1", api_key="x").completions.create(
            model="nope", prompt="Hi"
        )


def _twice_authorized(url: str, first: str, second: str) -> tuple[int, str]:
    """A GET with two Authorization headers (urllib sends one of each name)."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.putrequest("GET", parts.path)
        connection.putheader("Authorization", first)
        connection.putheader("Authorization", second)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_bearer_token_429_and_503_while_draining(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# a comment is no token\nsecret\n")
    server = start_server(
        "--devices",
        "cpu:1",
        "--step-ms",
        "10",
        "--max-concurrent",
        "1",
        "--auth-token-file",
        str(tokens),
        "--drain-timeout",
        "3",
        http=True,
    )
    base, auth = server.base, {"Authorization": "Bearer secret"}
    try:
        status, body = _get(base + "/v1/models")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert _get(base + "/v1/models", {"Authorization": "Bearer wrong"})[0] == 401
        assert (
            _get(base + "/v1/models", {"Authorization": "Bearer # a comment is no token"})[0] == 401
        )
        status, said = _twice_authorized(base + "/v1/models", "Bearer secret", "Bearer wrong")
        assert status == 401 and "send one Authorization header" in said
        assert _get(base + "/v1/models", auth)[0] == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="secret")
        with client.completions.create(
            model="cadence", prompt="Hi", max_tokens=200, stream=True
        ) as stream:
            next(iter(stream))  # the one slot is taken
            status, body = _post(
                base + "/v1/completions", {"model": "cadence", "prompt": "Hi"}, auth
            )
            assert status == 429 and body["error"]["code"] == "resource_exhausted"
            server.process.send_signal(signal.SIGTERM)  # drain: the open stream goes on
            deadline = time.monotonic() + 10
            while _get(base + "/health")[0] != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            status, body = _post(
                base + "/v1/completions", {"model": "cadence", "prompt": "Hi"}, auth
            )
            assert status == 503 and body["error"]["type"] == "service_unavailable_error"
            assert sum(1 for _ in stream) > 0
    finally:
        assert server.stop() == 0


def test_a_disconnect_frees_the_slot_at_once() -> None:
    server = start_server(
        "--devices", "cpu:1", "--step-ms", "50", "--max-concurrent", "1", http=True
    )
    try:
        host, port = server.base[7:].split(":")

        async def run() -> float:
            reader, writer = await asyncio.open_connection(host, int(port))
            body = json.dumps(
                {"model": "cadence", "prompt": "Hi", "max_tokens": 1000, "stream": True}
            ).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            while b"data: {" not in await reader.readline():
                pass
            writer.transport.abort()  # gone mid-stream
            closed = time.monotonic()
            while True:
                status, _ = await asyncio.to_thread(
                    _post,
                    server.base + "/v1/completions",
                    {"model": "cadence", "prompt": "Hi", "max_tokens": 1},
                )
                if status == 200:
                    return time.monotonic() - closed
                assert status == 429
                assert time.monotonic() - closed < 2, "the slot was never freed"

        assert asyncio.run(run()) < 1.0
    finally:
        assert server.stop() == 0


def test_every_front_serves_http_on_the_shared_port() -> None:
    server = start_server("--devices", "cpu:2", "--step-ms", "5", "--fronts", "2", http=True)
    try:
        port = int(server.base.rsplit(":", 1)[1])
        front = psutil.Process(server.process.pid)
        fronts = [front] + [
            p for p in front.children() if "cadence.lifecycle.front_child" in p.cmdline()
        ]
        assert len(fronts) == 2
        for process in fronts:
            listening = [
                c
                for c in process.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port
            ]
            assert listening, f"front pid {process.pid} does not listen on {port}"

        async def many() -> list[tuple[str, str]]:
            client = openai.AsyncOpenAI(
                base_url=server.base + "/v1", api_key="unused", max_retries=0
            )
            async with client:

                async def one() -> tuple[str, str]:
                    raw = await client.completions.with_raw_response.create(
                        model="cadence", prompt="Hi", max_tokens=6, stream=True
                    )
                    text = "".join([c.choices[0].text async for c in raw.parse()])
                    return raw.headers["cadence-front"], text

                return await asyncio.gather(*(one() for _ in range(24)))

        served = asyncio.run(many())  # 24 connections: the kernel spreads them over both
        assert {front for front, _ in served} == {"0", "1"}
        assert len({text for _, text in served}) == 1 and len(served[0][1]) == 6
    finally:
        assert server.stop() == 0


def test_the_lab_drives_the_http_front(http_server) -> None:
    from cadence.lab.bench import Workload, run_bench
    from cadence.lab.load.openai_http import OpenAITarget
    from cadence.lab.load.plan import RequestShape

    for endpoint in ("completions", "chat"):
        workload = Workload(
            requests=16,
            concurrency=8,
            shape=RequestShape(max_tokens=(12, 12), prompt_tokens=(8, 8)),
        )
        result = run_bench(
            "", workload, processes=2, protocol=OpenAITarget(http_server.base, "tiny-m", endpoint)
        )
        assert result.requests_ok == 16, result.errors_by_code
        assert result.output_tokens == 16 * 12
        assert result.workload.protocol == "openai"
        assert result.segments_ms, "cadence's timing extension gives the segments"
    result = run_bench(
        "",
        Workload(requests=2, concurrency=2),
        protocol=OpenAITarget(http_server.base, "other-model"),
    )
    assert result.errors_by_code == {"HTTP_404": 2}


def test_cadence_sweep_and_bench_cli_speak_openai(http_server, tmp_path) -> None:
    out = tmp_path / "sweep.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "sweep",
            "--protocol",
            "openai",
            "--vary",
            "concurrency=2,4",
            "--serve-args",
            "--devices cpu:1 --step-ms 5",
            "--max-tokens",
            "6",
            "--requests",
            "4",
            "--json",
            str(out),
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    points = msgspec.convert(json.loads(out.read_text()), SweepResult).sweep.points
    assert [p.repeats[0].requests_ok for p in points] == [4, 4]
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "bench",
            "--protocol",
            "openai",
            "--target",
            http_server.target,
            "--model",
            "tiny-m",
        ],
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert bench.returncode != 0 and "http://HOST:PORT" in bench.stderr
    port = int(http_server.base.rsplit(":", 1)[1])
    closed = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "bench",
            "--protocol",
            "openai",
            "--target",
            f"http://127.0.0.1:{port}/nothing-here-x",
            "--requests",
            "1",
        ],
        timeout=60,
        capture_output=True,
        text=True,
    )
    # A 404 is an answer: the run goes on and records it, and since no request succeeded,
    # the bench exits non-zero with one line saying so.
    assert "HTTP_404" in closed.stdout
    assert closed.returncode != 0
    assert closed.stderr == "cadence bench: every request failed (HTTP_404)\n"


def test_bench_openai_at_a_grpc_port_says_so_in_one_line(http_server) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence.cli",
            "bench",
            "--protocol",
            "openai",
            "--target",
            f"http://{http_server.target}",
            "--requests",
            "1",
        ],
        timeout=60,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"cadence bench: no HTTP server answers at http://{http_server.target}")


def test_tls_and_mutual_tls_as_for_grpc(pki: Pki) -> None:  # noqa: F811 (the fixture)
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    server = start_server(
        "--devices",
        "cpu:1",
        "--step-ms",
        "5",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
        tls_context=context,
        http=True,
    )
    try:
        http_client = openai.DefaultHttpxClient(verify=context)
        client = openai.OpenAI(
            base_url=server.base + "/v1", api_key="x", max_retries=0, http_client=http_client
        )
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="cadence", prompt="Hi", max_tokens=4, stream=True
            )
        )
        assert len(text) == 4
        plain = server.base.replace("https://", "http://")
        assert _get(plain + "/health")[0] == 0  # plaintext: no answer
        no_cert = ssl.create_default_context(cafile=str(pki.ca))
        assert _get(server.base + "/health", context=no_cert)[0] == 0  # refused in handshake
    finally:
        assert server.stop() == 0


@pytest.mark.slow
@pytest.mark.torch
def test_torch_chat_uses_the_checkpoint_template(tmp_path) -> None:
    """The prompt the torch engine gets for `messages` is transformers' own
    `apply_chat_template(add_generation_prompt=True)`, and its greedy reply is transformers'."""
    pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")
    pytest.importorskip("jinja2", reason="chat templates need the torch extra's jinja2")
    from transformers import AutoTokenizer

    from tests.llama_models import hf_greedy, save_model

    folder = save_model(tmp_path / "model")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}the{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    messages = [
        {"role": "system", "content": "the lazy dog"},
        {"role": "user", "content": "a quick fox"},
    ]
    expected_ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected_ids = list(getattr(expected_ids, "input_ids", expected_ids))
    server = start_server(
        "--engine", "torch", "--model", str(folder), "--kv-cache-tokens", "1024", http=True
    )
    try:
        status, body = _post(
            server.base + "/v1/chat/completions",
            {"model": "cadence", "messages": messages, "max_tokens": 6, "temperature": 0},
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(expected_ids)
        status, tokens = _post(
            server.base + "/v1/completions",
            {"model": "cadence", "prompt": expected_ids, "max_tokens": 6, "temperature": 0},
        )
        assert tokens["choices"][0]["text"] == body["choices"][0]["message"]["content"]
        assert len(hf_greedy(folder, expected_ids, 6)) == body["usage"]["completion_tokens"]
    finally:
        assert server.stop() == 0


def test_the_served_model_name_is_kserve_s_too(http_server) -> None:
    import grpc

    from cadence.proto.kserve import grpc_service_pb2 as kpb
    from cadence.proto.kserve import grpc_service_pb2_grpc as kpb_grpc

    with grpc.insecure_channel(http_server.target) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelReady(kpb.ModelReadyRequest(name="tiny-m"), timeout=10).ready
        assert stub.ModelMetadata(kpb.ModelMetadataRequest(name="tiny-m"), timeout=10).name == (
            "tiny-m"
        )

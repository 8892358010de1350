"""How soon `--stall-timeout` cuts off a client that stops reading, on every path.

HTTP (OpenAI SSE): a client with a 4 KiB receive buffer reads the response's headers, then
nothing; measured from when its receive queue last grew (from then on it acknowledges
nothing) to when the server no longer holds the connection. gRPC (grpc.aio and
`--grpc-server native`): a grpcio client with a 1 KiB window reads one message, then nothing;
measured from that message to when a second stream is admitted (`--max-concurrent 1`: the
stalled one's slot is free), which includes filling the client's window (and on native Envoy's
64 KiB buffer for the stream) before the timeout starts.

    flock /work/bench.lock python benchmarks/stall_cutoff.py [--out results/stall_cutoff.json]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import socket
import sys
import termios
import time
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).parents[1]))
from cadence.client import Client, build_request
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.conftest import start_server

STALL_S = 2.0
_GIVE_UP_S = 180.0


def _server(step_ms: str, *args: str):
    return start_server(
        "--step-ms",
        step_ms,
        "--stall-timeout",
        f"{STALL_S:g}",
        "--max-concurrent",
        "1",
        "--max-tokens-limit",
        "1000000",
        *args,
    )


def http_cutoff(step_ms: str) -> dict:
    server = _server(step_ms, "--http-port", "0", "--served-model-name", "m")
    try:
        front = psutil.Process(server.process.pid)
        grpc_port = int(server.target.rsplit(":", 1)[1])
        http_port = next(
            c.laddr.port
            for c in front.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port != grpc_port
        )
        body = json.dumps(
            {"model": "m", "prompt": "Hi", "max_tokens": 1_000_000, "stream": True}
        ).encode()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", http_port))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        assert client.recv(15).startswith(b"HTTP/1.1 200")
        port, queued, last, grew = client.getsockname()[1], bytearray(4), -1, time.monotonic()
        started = time.monotonic()
        while True:
            fcntl.ioctl(client.fileno(), termios.FIONREAD, queued)
            now = time.monotonic()
            if int.from_bytes(queued, "little") != last:
                last, grew = int.from_bytes(queued, "little"), now
            held = [
                c
                for c in front.net_connections("tcp")
                if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            ]
            if not held or now - started > _GIVE_UP_S:
                break
            time.sleep(0.05)
        client.close()
        return {
            "path": "http",
            "step_ms": float(step_ms),
            "cut": not held,
            "s_after_the_client_took_its_last_byte": round(now - grew, 2),
            "s_after_it_stopped_reading": round(now - started, 2),
        }
    finally:
        server.stop()


def grpc_cutoff(step_ms: str, *args: str) -> dict:
    server = _server(step_ms, *args)
    try:
        channel = grpc.insecure_channel(
            server.target,
            options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)],
        )
        stalled = pb_grpc.InferenceStub(channel).Generate(
            build_request("stall", max_tokens=1_000_000), timeout=_GIVE_UP_S + 30
        )
        next(stalled)
        started = time.monotonic()
        freed = False
        with Client(server.target) as client:
            while time.monotonic() - started < _GIVE_UP_S:
                try:
                    list(client.generate("next", max_tokens=2))
                    freed = True
                    break
                except grpc.RpcError:
                    time.sleep(0.1)
        channel.close()
        return {
            "path": "grpc-native" if args else "grpc-aio",
            "step_ms": float(step_ms),
            "cut": freed,
            "s_after_it_stopped_reading": round(time.monotonic() - started, 2),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/stall_cutoff.json")
    args = parser.parse_args()
    runs = []
    for step_ms in ("2", "20"):
        for cutoff, extra in (
            (http_cutoff, ()),
            (grpc_cutoff, ()),
            (grpc_cutoff, ("--grpc-server", "native")),
        ):
            runs.append(cutoff(step_ms, *extra))
            print(json.dumps(runs[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "flock /work/bench.lock python benchmarks/stall_cutoff.py "
                + " ".join(sys.argv[1:]),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "stall_timeout_s": STALL_S,
                "machine": {
                    "cpus": psutil.cpu_count(),
                    "platform": platform.platform(),
                    "host": "2 cores, shared",
                    "load_1min_at_end": round(os.getloadavg()[0], 2),
                },
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

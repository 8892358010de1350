"""Peers that give the lab more than it should take in, for tests/integration/test_lab_bounds.py.

    python tests/unbounded_peers.py page [--trickle-after N] [--size BYTES] [--port 0]
    python tests/unbounded_peers.py grpc [--silent-after N] [--then K] [--message-bytes B]

`page` serves a Prometheus page on /metrics, written as vLLM writes its own: the first
`--trickle-after` GETs get it whole, every later one gets its headers and then one byte a
second for as long as the client stays (0: from the first GET). `--size` pads the page with
gauges to that many bytes and sends it with no Content-Length, so a client learns its size
only by reading it.

`grpc` is the worked example's token service (examples/thread_pool/tokens.proto, reflection
on): each call gets `max_tokens` Tokens 5 ms apart, each `--message-bytes` long (its `text`
padded); past the first `--silent-after` calls, a call gets `--then` Tokens and then nothing,
never ending. Each prints `listening on HOST:PORT` once serving and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import signal
import sys
import threading
import time

PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="stand-in"} 4
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="stand-in"} 2
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="stand-in"} 100
"""


def page(args: argparse.Namespace) -> None:
    gets = 0
    lock = threading.Lock()
    body = PAGE.encode()
    if args.size > len(body):
        pad = [b"# TYPE padding gauge\n"]
        n, size = 0, len(body) + len(pad[0])
        while size < args.size:
            line = b'padding{n="%d"} 1\n' % n
            pad.append(line)
            size += len(line)
            n += 1
        body += b"".join(pad)

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            nonlocal gets
            with lock:
                gets += 1
                trickle = gets > args.trickle_after
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            if trickle:
                self.end_headers()
                try:
                    for byte in body:
                        self.wfile.write(bytes((byte,)))
                        self.wfile.flush()
                        time.sleep(1.0)
                except OSError:
                    pass  # the client gave up
                return
            if args.size:
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                self.wfile.write(body)
                return
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Page)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on 127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    sys.exit(0)


async def tokens(args: argparse.Namespace) -> None:
    import grpc
    from grpc_reflection.v1alpha import reflection

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "thread_pool")
    )
    protos, services = grpc.protos_and_services("tokens.proto")
    calls = 0
    never = asyncio.Event()
    pad = "x" * args.message_bytes

    class TokenService(services.TokenServiceServicer):
        async def Generate(self, request, context):
            nonlocal calls
            calls += 1
            silent = calls > args.silent_after
            for i in range(request.max_tokens):
                if silent and i == args.then:
                    await never.wait()
                await asyncio.sleep(0.005)
                yield protos.Token(index=i, text=pad or f"t{i} ", count=1)

    server = grpc.aio.server()
    services.add_TokenServiceServicer_to_server(TokenService(), server)
    name = protos.DESCRIPTOR.services_by_name["TokenService"].full_name
    reflection.enable_server_reflection((name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="peer", required=True)
    p = sub.add_parser("page")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--trickle-after", type=int, default=1 << 30)
    p.add_argument("--size", type=int, default=0)
    g = sub.add_parser("grpc")
    g.add_argument("--silent-after", type=int, default=1 << 30)
    g.add_argument("--then", type=int, default=0)
    g.add_argument("--message-bytes", type=int, default=0)
    parsed = parser.parse_args()
    if parsed.peer == "page":
        page(parsed)
    else:
        asyncio.run(tokens(parsed))

"""A gRPC server that cadence did not write, for `cadence bench --protocol grpc` tests.

`ticker_server()` starts tests/node/ticker_server.js (Node.js, @grpc/grpc-js, with server
reflection from @grpc/reflection) on a free loopback port and yields its "HOST:PORT". Its
service, ticker.v1.Ticker, is in tests/node/protos (PROTO_PATH) as PROTO_FILE, which imports
ticker/v1/tick.proto. The Node packages come from `npm ci --prefix tests/node`.

Count (server streaming) takes a CountRequest {count, first_delay_ms, gap_ms, label,
words_per_tick, fail_after} and sends `count` Ticks {seq, words, label, first_word}: the first
after first_delay_ms, then one every gap_ms on absolute times from the call's start. Each Tick
has words_per_tick words (0 means 1) named w<N>, N counting from first_word = seq *
words_per_tick. fail_after > 0 ends the call with RESOURCE_EXHAUSTED "planted failure after N
ticks" right after N Ticks; count < 0 is INVALID_ARGUMENT. Chat (bidi) serves its first request
as Count and then ends; Once (unary) returns one Tick. With a token, calls need metadata
`authorization: Bearer TOKEN`, else UNAUTHENTICATED.

Reflection (grpc.reflection.v1 and v1alpha) serves, by default, what stock @grpc/reflection
serves: @grpc/proto-loader's descriptors, ONE file per package, "ticker_v1.proto" (MERGED_FILE),
holding CountRequest, Tick and Ticker with no imports. `source_files=True` makes it serve one
file per .proto instead (PROTO_FILE importing TICK_PROTO_FILE), as protoc-based servers do.

Importable from the repository root (the tests put the root on PYTHONPATH), like tests/apps.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NODE_DIR = Path(__file__).resolve().parent / "node"
REPO_ROOT = NODE_DIR.parent.parent
SERVER_JS = NODE_DIR / "ticker_server.js"
PROTO_PATH = str(NODE_DIR / "protos")
PROTO_FILE = "ticker/v1/ticker.proto"
TICK_PROTO_FILE = "ticker/v1/tick.proto"
MERGED_FILE = "ticker_v1.proto"
SERVICE = "ticker.v1.Ticker"
COUNT_METHOD = "ticker.v1.Ticker/Count"
CHAT_METHOD = "ticker.v1.Ticker/Chat"
ONCE_METHOD = "ticker.v1.Ticker/Once"

INSTALL_HINT = "run `npm ci --prefix tests/node` from the repository root"
START_TIMEOUT_S = 30.0


def node_available() -> str | None:
    """Why the Node ticker server cannot run here, or None when it can (for pytest skips)."""
    if shutil.which("node") is None:
        return f"node is not on PATH (install Node.js 20+, then {INSTALL_HINT})"
    for package in ("grpc-js", "proto-loader", "reflection"):
        if not (NODE_DIR / "node_modules" / "@grpc" / package / "package.json").is_file():
            return f"tests/node/node_modules lacks @grpc/{package}: {INSTALL_HINT}"
    return None


@contextmanager
def ticker_server(
    reflection: bool = True, token: str | None = None, *, source_files: bool = False
) -> Iterator[str]:
    """Run the Node ticker server on 127.0.0.1 and a free port; yield "HOST:PORT".

    reflection=False: no reflection service. token: require `authorization: Bearer TOKEN`.
    source_files=True: reflection serves the real per-file descriptors (see the module doc).
    """
    problem = node_available()
    if problem is not None:
        raise RuntimeError(f"cannot start the Node gRPC ticker server: {problem}")
    args = ["node", str(SERVER_JS), "--port", "0", "--host", "127.0.0.1"]
    if not reflection:
        args.append("--no-reflection")
    if token is not None:
        args += ["--require-token", token]
    if source_files:
        args.append("--source-files")
    proc = subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NODE_NO_WARNINGS": "1"},
    )
    drain: list[threading.Thread] = []
    try:
        yield _wait_listening(proc, drain)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for thread in drain:
            thread.join(5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _wait_listening(proc: subprocess.Popen[str], drain: list[threading.Thread]) -> str:
    """Read the server's "listening on HOST:PORT" line (a thread, so a timeout can apply)."""
    assert proc.stdout is not None and proc.stderr is not None
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    first = line[0].strip() if line else ""
    if first.startswith("listening on "):
        # Keep stderr drained so a chatty server never blocks on a full pipe.
        drain.append(threading.Thread(target=proc.stderr.read, daemon=True))
        drain[0].start()
        return first.removeprefix("listening on ")
    if proc.poll() is None:
        proc.kill()
    try:
        _, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        err = ""
    what = (
        f"printed {first!r}"
        if first
        else (
            f"exited with code {proc.returncode}"
            if line
            else f"said nothing within {START_TIMEOUT_S:.0f} s"
        )
    )
    raise RuntimeError(
        f"the Node gRPC ticker server {what} instead of 'listening on HOST:PORT' "
        f"(if its packages are missing, {INSTALL_HINT}); stderr:\n{(err or '').strip()}"
    )

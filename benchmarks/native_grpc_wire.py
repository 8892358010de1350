"""Wire checks: does each server of benchmarks/native_grpc_server.py speak gRPC as
real clients expect? Three clients, each against every server kind:

- grpcio (the C-core client) and @grpc/grpc-js (Node, benchmarks/native_grpc_wire.js):
  `ok` (5 messages in order, then status OK from the trailers), `error` (3 messages, then
  INVALID_ARGUMENT with a message that needs percent-decoding), `deadline` (a 300 ms deadline on
  a 2.5 s stream: DEADLINE_EXCEEDED, and the server read the deadline), `cancel` (the client
  cancels after 2 messages, which resets the HTTP/2 stream: the handler must end);
- a raw HTTP/2 client (h2), which neither enforces a deadline nor cancels unless told:
  `server_deadline` (sends `grpc-timeout: 200m` and waits: the server itself must end the call
  with DEADLINE_EXCEEDED) and `rst_stream` (sends RST_STREAM(CANCEL) after 2 messages);
- `cancel_idle` (grpcio) and `rst_idle` (h2): the stream waits a second before its first
  message, as one in a queue or a long prefill does, and the client cancels (resets) it
  0.2 s in, before any message: the handler must end as after any other reset.

The server writes when each stream starts (with the deadline it read) and ends, and how, to an
event file (NATIVE_GRPC_EVENTS); a check reads it to see the server's side. Times are
CLOCK_MONOTONIC on both sides.

    python benchmarks/native_grpc_wire.py [--out results/native_grpc_wire.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote

import grpc
import h2.config
import h2.connection
import h2.events

sys.path.insert(0, str(Path(__file__).parent))
from native_grpc_server import (
    EVENTS_ENV,
    IDLE_S,
    KINDS,
    PATH,
    PLANTED_MESSAGE,
)

from cadence.lab.servers.server_process import ServerProcess
from cadence.proto.v1 import inference_pb2 as pb

_HERE = Path(__file__).parent
STEP_MS = 25
DEADLINE_S = 0.3
SERVER_DEADLINE = "200m"
HANDLER_END_WITHIN_S = 0.1
"""After a deadline or a reset, the handler must have ended within this (4 steps)."""
CANCEL_IDLE_S = 0.2
"""When `cancel_idle` and `rst_idle` reset a stream that has sent nothing yet (it waits IDLE_S)."""


def request(name: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=name, max_tokens=max_tokens)


CASES = {  # name: (request id, max_tokens, timeout s, cancel after N messages)
    "ok": ("ok", 5, None, 0),
    "error": ("abort:error", 3, None, 0),
    "deadline": ("deadline", 100, DEADLINE_S, 0),
    "cancel": ("cancel", 100, None, 2),
}


def read_events(path: str) -> dict[str, list[tuple[float, list[str]]]]:
    """{request id: [(time, words)]} from the server's event file."""
    out: dict[str, list] = {}
    if not os.path.exists(path):
        return out
    for line in Path(path).read_text().splitlines():
        t, kind, rid, *rest = line.split(" ")
        out.setdefault(rid, []).append((float(t), [kind, *rest]))
    return out


def server_side(events: dict, rid: str) -> dict:
    """What the server saw of one call: the deadline it read, and how and when the handler
    ended."""
    seen = events.get(rid, [])
    start = next((words for _, words in seen if words[0] == "start"), None)
    end = next(((t, words) for t, words in seen if words[0] == "end"), None)
    return {
        "timeout_read_s": start[2] if start else None,
        "handler_end": " ".join(end[1][1:]) if end else None,
        "handler_end_at_s": end[0] if end else None,
    }


def indexes(messages: list[bytes]) -> list[int]:
    return [pb.GenerateChunk.FromString(m).index for m in messages]


# --- grpcio ---------------------------------------------------------------------------------


def grpcio_case(
    target: str, name: str, rid: str, tokens: int, timeout: float | None, cancel_after: int
) -> dict:
    rid = f"grpcio-{rid}" if not rid.startswith("abort:") else f"abort:grpcio-{name}"
    with grpc.insecure_channel(target) as channel:
        generate = channel.unary_stream(
            PATH, request_serializer=pb.GenerateRequest.SerializeToString
        )
        started = time.monotonic()
        call = generate(request(rid, tokens), timeout=timeout)
        messages, cancel_at = [], None
        try:
            for data in call:
                messages.append(data)
                if cancel_after and len(messages) == cancel_after:
                    cancel_at = time.monotonic()
                    call.cancel()
                    break
        except grpc.RpcError:
            pass
        code, details = call.code(), call.details()
        trailers = dict(call.trailing_metadata() or ()) if code != grpc.StatusCode.CANCELLED else {}
    return {
        "rid": rid,
        "code": code.value[0],
        "code_name": code.name,
        "details": details,
        "trailers": trailers,
        "indexes": indexes(messages),
        "started_at_s": started,
        "ended_at_s": time.monotonic(),
        "cancel_at_s": cancel_at,
    }


def grpcio_cancel_idle(target: str) -> dict:
    """Cancel a call CANCEL_IDLE_S in, before its first message."""
    rid = "idle:grpcio-cancel"
    with grpc.insecure_channel(target) as channel:
        generate = channel.unary_stream(
            PATH, request_serializer=pb.GenerateRequest.SerializeToString
        )
        started = time.monotonic()
        call = generate(request(rid, 5))
        time.sleep(CANCEL_IDLE_S)
        cancel_at = time.monotonic()
        call.cancel()
        code = call.code()
    return {
        "rid": rid,
        "code": code.value[0],
        "code_name": code.name,
        "details": call.details(),
        "trailers": {},
        "indexes": [],
        "started_at_s": started,
        "ended_at_s": time.monotonic(),
        "cancel_at_s": cancel_at,
    }


# --- grpc-js --------------------------------------------------------------------------------


def grpcjs_cases(target: str) -> dict[str, dict]:
    cases = []
    for name, (rid, tokens, timeout, cancel_after) in CASES.items():
        rid = f"grpcjs-{rid}" if not rid.startswith("abort:") else f"abort:grpcjs-{name}"
        cases.append(
            {
                "name": name,
                "rid": rid,
                "request_hex": request(rid, tokens).SerializeToString().hex(),
                "timeout_ms": int(timeout * 1e3) if timeout else 0,
                "cancel_after": cancel_after,
            }
        )
    done = subprocess.run(
        ["node", str(_HERE / "native_grpc_wire.js"), target, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode:
        return {c["name"]: {"error": done.stderr[-2000:]} for c in cases}
    out = {}
    for line, case in zip(done.stdout.splitlines(), cases, strict=True):
        r = json.loads(line)
        code_names = {c.value[0]: c.name for c in grpc.StatusCode}
        out[r["name"]] = {
            "rid": case["rid"],
            "code": r["code"],
            "code_name": code_names.get(r["code"]),
            "details": r["details"],
            "trailers": r["trailers"],
            "indexes": indexes([bytes.fromhex(m) for m in r["messages_hex"]]),
            "started_at_s": r["started_at_s"],
            "ended_at_s": r["ended_at_s"],
            "cancel_at_s": r["cancel_at_s"],
        }
    return out


# --- raw HTTP/2 ------------------------------------------------------------------------------


def h2_call(
    target: str,
    rid: str,
    tokens: int,
    grpc_timeout: str | None,
    rst_after: int,
    wait_s: float = 3.0,
    rst_after_s: float | None = None,
) -> dict:
    """One call on a bare HTTP/2 connection: what came back, frame by frame; RST_STREAM after
    `rst_after` messages, or `rst_after_s` seconds."""
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=wait_s)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PATH),
        (":authority", target),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if grpc_timeout:
        headers.append(("grpc-timeout", grpc_timeout))
    body = request(rid, tokens).SerializeToString()
    conn.send_headers(1, headers)
    conn.send_data(1, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
    sock.sendall(conn.data_to_send())
    started = time.monotonic()
    out: dict = {
        "rid": rid,
        "headers": None,
        "trailers": None,
        "reset_by_server": None,
        "messages": 0,
        "started_at_s": started,
        "rst_at_s": None,
    }
    buffer = b""
    deadline = started + wait_s
    try:
        while time.monotonic() < deadline:
            if rst_after_s is not None and out["rst_at_s"] is None:
                if time.monotonic() - started >= rst_after_s:
                    conn.reset_stream(1, error_code=8)  # CANCEL
                    sock.sendall(conn.data_to_send())
                    out["rst_at_s"] = time.monotonic()
                    deadline = min(deadline, out["rst_at_s"] + 0.5)
                    continue
                sock.settimeout(max(0.001, started + rst_after_s - time.monotonic()))
            else:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                if rst_after_s is not None and out["rst_at_s"] is None:
                    continue  # time to reset
                break
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    out["headers"] = dict(ev.headers)
                elif isinstance(ev, h2.events.DataReceived):
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    buffer += ev.data
                    while len(buffer) >= 5 and len(buffer) >= 5 + int.from_bytes(
                        buffer[1:5], "big"
                    ):
                        buffer = buffer[5 + int.from_bytes(buffer[1:5], "big") :]
                        out["messages"] += 1
                    if rst_after and out["messages"] >= rst_after and out["rst_at_s"] is None:
                        conn.reset_stream(1, error_code=8)  # CANCEL
                        out["rst_at_s"] = time.monotonic()
                        deadline = min(deadline, out["rst_at_s"] + 0.5)
                elif isinstance(ev, h2.events.TrailersReceived):
                    out["trailers"] = dict(ev.headers)
                    out["trailers_at_s"] = time.monotonic()
                elif isinstance(ev, h2.events.StreamReset):
                    out["reset_by_server"] = ev.error_code
                    out["reset_at_s"] = time.monotonic()
            sock.sendall(conn.data_to_send())
            ended = out["trailers"] is not None or out["reset_by_server"] is not None
            if ended and not rst_after and rst_after_s is None:
                break
    finally:
        sock.close()
    return out


# --- the checks ------------------------------------------------------------------------------


def judge(name: str, client: dict, server: dict) -> tuple[bool, str]:
    """Whether one client call passed, and why not."""
    if "error" in client:
        return False, client["error"][-300:]
    if name == "ok":
        ok = client["code"] == 0 and client["indexes"] == [0, 1, 2, 3, 4]
        return ok, "" if ok else f"code {client['code']}, indexes {client['indexes']}"
    if name == "error":
        ok = (
            client["code"] == 3
            and client["details"] == PLANTED_MESSAGE
            and client["indexes"] == [0, 1, 2]
        )
        return ok, "" if ok else f"code {client['code']}, details {client['details']!r}"
    if name == "deadline":
        read = server["timeout_read_s"]
        ended = server["handler_end_at_s"]
        why = []
        if client["code"] != 4:
            why.append(f"client code {client['code']}")
        if read in (None, "none") or not 0 < float(read) <= DEADLINE_S:
            why.append(f"server read timeout {read}")
        if ended is None or ended - client["started_at_s"] > DEADLINE_S + HANDLER_END_WITHIN_S:
            why.append(
                f"handler end {server['handler_end']} at "
                f"{None if ended is None else round(ended - client['started_at_s'], 3)} s"
            )
        return not why, "; ".join(why)
    if name in ("cancel", "cancel_idle"):
        ended = server["handler_end_at_s"]
        why = []
        if client["code"] != 1:
            why.append(f"client code {client['code']}")
        if server["handler_end"] is None or not server["handler_end"].startswith("cancelled"):
            why.append(f"handler end {server['handler_end']}")
        elif ended - client["cancel_at_s"] > HANDLER_END_WITHIN_S:
            why.append(f"handler ended {ended - client['cancel_at_s']:.3f} s after the cancel")
        return not why, "; ".join(why)
    raise ValueError(name)


def check_server(kind: str) -> dict:
    fd, events_file = tempfile.mkstemp(prefix="native-grpc-events-")
    os.close(fd)
    os.environ[EVENTS_ENV] = events_file  # the server (and pyvoy's Envoy) inherit it
    command = [sys.executable, str(_HERE / "native_grpc_server.py"), "--kind", kind]
    results: dict = {"grpcio": {}, "grpc-js": {}, "h2": {}}
    try:
        with ServerProcess("--step-ms", str(STEP_MS), command=command) as server:
            target = server.target
            for name, (rid, tokens, timeout, cancel_after) in CASES.items():
                results["grpcio"][name] = grpcio_case(
                    target, name, rid, tokens, timeout, cancel_after
                )
            results["grpcio"]["cancel_idle"] = grpcio_cancel_idle(target)
            results["grpc-js"] = grpcjs_cases(target)
            results["h2"]["server_deadline"] = h2_call(
                target, "h2-server-deadline", 100, SERVER_DEADLINE, 0
            )
            results["h2"]["rst_stream"] = h2_call(target, "h2-rst", 100, None, 2)
            results["h2"]["rst_idle"] = h2_call(
                target, "idle:h2-rst", 5, None, 0, rst_after_s=CANCEL_IDLE_S
            )
            time.sleep(
                IDLE_S
            )  # the handler's last event after a reset (at worst at its first message)
    finally:
        os.environ.pop(EVENTS_ENV, None)
    events = read_events(events_file)
    os.unlink(events_file)
    verdicts: dict = {}
    for client in ("grpcio", "grpc-js"):
        for name, r in results[client].items():
            r["server"] = server_side(events, r.get("rid", ""))
            ok, why = judge(name, r, r["server"])
            if (
                name.startswith("cancel")
                and r["server"]["handler_end_at_s"]
                and r.get("cancel_at_s")
            ):
                r["handler_end_after_cancel_ms"] = round(
                    (r["server"]["handler_end_at_s"] - r["cancel_at_s"]) * 1e3, 1
                )
            verdicts[f"{client} {name}"] = {"pass": ok, **({"why": why} if why else {})}
            if "handler_end_after_cancel_ms" in r:
                verdicts[f"{client} {name}"]["handler_end_after_ms"] = r[
                    "handler_end_after_cancel_ms"
                ]
    d = results["h2"]["server_deadline"]
    d["server"] = server_side(events, d["rid"])
    status = (d["trailers"] or {}).get("grpc-status") or (d["headers"] or {}).get("grpc-status")
    d["grpc_status"] = status
    end_t = d.get("trailers_at_s") or d.get("reset_at_s")
    d["ended_after_s"] = round(end_t - d["started_at_s"], 3) if end_t else None
    ok = status == "4" and d["ended_after_s"] is not None and d["ended_after_s"] < 0.2 + 0.1
    verdicts["h2 server_deadline"] = {
        "pass": ok,
        **(
            {}
            if ok
            else {
                "why": f"grpc-status {status}, reset {d['reset_by_server']}, after {d['ended_after_s']} s"
            }
        ),
    }
    for name in ("rst_stream", "rst_idle"):
        r = results["h2"][name]
        r["server"] = server_side(events, r["rid"])
        ended = r["server"]["handler_end_at_s"]
        r["handler_end_after_rst_ms"] = (
            round((ended - r["rst_at_s"]) * 1e3, 1) if ended and r["rst_at_s"] else None
        )
        ok = (
            (r["server"]["handler_end"] or "").startswith("cancelled")
            and r["handler_end_after_rst_ms"] is not None
            and r["handler_end_after_rst_ms"] < HANDLER_END_WITHIN_S * 1e3
        )
        verdicts[f"h2 {name}"] = {
            "pass": ok,
            "handler_end_after_ms": r["handler_end_after_rst_ms"],
            **(
                {}
                if ok
                else {
                    "why": f"handler end {r['server']['handler_end']} {r['handler_end_after_rst_ms']} ms"
                }
            ),
        }
    for case in results["grpcio"].values():
        if isinstance(case.get("details"), str):
            case["details_unquoted"] = unquote(case["details"])
    return {
        "verdicts": verdicts,
        "all_pass": all(v["pass"] for v in verdicts.values()),
        "calls": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--out", default="results/native_grpc_wire.json")
    args = parser.parse_args()
    out = {
        "command": " ".join(["python benchmarks/native_grpc_wire.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "step_ms": STEP_MS,
        "deadline_s": DEADLINE_S,
        "server_deadline": SERVER_DEADLINE,
        "handler_end_within_s": HANDLER_END_WITHIN_S,
        "idle_s": IDLE_S,
        "cancel_idle_s": CANCEL_IDLE_S,
        "servers": {},
    }
    for kind in args.servers:
        r = check_server(kind)
        out["servers"][kind] = r
        for check, v in r["verdicts"].items():
            after = (
                f" (handler ended {v['handler_end_after_ms']} ms after the reset)"
                if "handler_end_after_ms" in v
                else ""
            )
            print(
                f"{kind:13s} {check:22s} {'pass' if v['pass'] else 'FAIL ' + v.get('why', '')}"
                f"{after}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

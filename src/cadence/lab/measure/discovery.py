"""Where a server's processes are: a cadence server's fronts and workers, or whatever process
listens on the target's port, and the address of its metrics page."""

from __future__ import annotations

import contextlib

import psutil

_FRONT_CHILD = "cadence.lifecycle.front_child"
"""The module fronts 1..N-1 of `cadence serve --fronts N` run as (children of front 0)."""


def server_processes(target: str) -> dict[str, int]:
    """The processes of a server listening on this host, else {}.

    One front: {"front": pid, "worker0": pid, ...}. With `--fronts N` every front listens on
    the port (SO_REUSEPORT), so the first listener may be any of them: this finds front 0
    (the one that launched the workers and the other fronts) and returns {"front0": pid,
    "front1": pid, ..., "worker0": pid, ...}. A worker is named by its index; the other
    ranks of a tensor-parallel group as "worker{index}.rank{rank}".
    """
    front = _front_zero(target)
    if front is None:
        return {}
    fronts: dict[int, int] = {}
    workers = []
    for child in sorted(front.children(), key=lambda p: p.pid):
        k = _front_index(child)
        if k is None:
            workers.append(child)
        else:
            fronts[k] = _hosted(child).pid
    if fronts:
        found = {"front0": front.pid, **{f"front{k}": fronts[k] for k in sorted(fronts)}}
    else:
        found = {"front": front.pid}
    for i, child in enumerate(workers):
        spec = _worker_spec(child)
        if spec is None:
            found[f"worker{i}"] = child.pid
        else:
            index, rank, _ = spec
            found[f"worker{index}" + (f".rank{rank}" if rank else "")] = child.pid
    return found


def _worker_spec(process: psutil.Process) -> tuple[int, int, str] | None:
    """(index, rank, device) of a `python -m cadence.worker SPEC` process, else None."""
    spec = _spec(process)
    try:
        return int(spec["index"]), int(spec.get("rank", 0)), str(spec["device"])
    except (KeyError, TypeError, ValueError):
        return None


def _spec(process: psutil.Process) -> dict:
    """The start-up spec of a `python -m cadence.worker SPEC` process; {} for another."""
    import json

    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return {}
    if "cadence.worker" not in cmdline or not cmdline[-1].startswith("{"):
        return {}
    try:
        spec = json.loads(cmdline[-1])
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


def worker_devices(target: str) -> dict[int, str]:
    """{worker index: its device(s)} of a cadence server on this host, from its worker
    processes' start-up specs (a tensor-parallel group: its ranks' devices, joined by "+")."""
    front = _front_zero(target)
    if front is None:
        return {}
    found: dict[int, list[tuple[int, str]]] = {}
    for child in front.children():
        spec = _worker_spec(child)
        if spec is not None:
            found.setdefault(spec[0], []).append((spec[1], spec[2]))
    return {k: "+".join(d for _, d in sorted(v)) for k, v in found.items()}


def worker_roles(target: str) -> dict[int, str]:
    """{worker index: its role} of a disaggregated cadence server on this host ("prefill"
    or "decode", from its worker processes' start-up specs); {} for another server."""
    front = _front_zero(target)
    if front is None:
        return {}
    found = {}
    for child in front.children():
        spec = _spec(child)
        if spec.get("role") and isinstance(spec.get("index"), int):
            found[spec["index"]] = str(spec["role"])
    return found


def _listeners(target: str) -> list[int]:
    """The pids listening on the target's port, when the target is on this host."""
    host, _, port = target.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "0.0.0.0", "[::1]", "::1") or not port.isdigit():
        return []
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return []
    return sorted(
        {
            c.pid
            for c in connections
            if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port) and c.pid
        }
    )


def listener_pid(target: str) -> int | None:
    """The process listening on the target's port on this host (any server), else None."""
    found = _listeners(target)
    return found[0] if found else None


def _front_zero(target: str) -> psutil.Process | None:
    """Front 0 of a server listening on this host: a listener on the port that is not a child
    front (a child front's parent is front 0; with `--grpc-server native` a child front's
    Envoy listens, and its parent is the child front's process)."""
    for pid in _listeners(target):
        try:
            process = psutil.Process(pid)
            parent = process.parent()
            if _front_index(process) is None:
                if parent is not None and _front_index(parent) is not None:
                    return parent.parent()
                return process
        except psutil.Error:
            continue
        if parent is not None:
            return parent
    return None


def _hosted(front_child: psutil.Process) -> psutil.Process:
    """The process a child front serves from: its own, or the Envoy it started
    (`--grpc-server native`)."""
    try:
        return next((p for p in front_child.children() if p.name() == "envoy"), front_child)
    except psutil.Error:
        return front_child


def _front_index(process: psutil.Process) -> int | None:
    """K for a `python -m cadence.lifecycle.front_child K ...` process, else None."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return None
    if _FRONT_CHILD in cmdline:
        i = cmdline.index(_FRONT_CHILD)
        if i + 1 < len(cmdline) and cmdline[i + 1].isdigit():
            return int(cmdline[i + 1])
    return None


def _metrics_port_arg(process: psutil.Process) -> int | None:
    """N of `--metrics-port N` (or `--metrics-port=N`) on the process's command line; None
    without the flag (or when the command line cannot be read)."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return None
    for k, arg in enumerate(cmdline):
        value = (
            arg.partition("=")[2]
            if arg.startswith("--metrics-port=")
            else cmdline[k + 1]
            if arg == "--metrics-port" and k + 1 < len(cmdline)
            else None
        )
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def _serves_cadence_metrics(url: str) -> bool:
    """Whether `url` answers with cadence's Prometheus page (not, say, the HTTP port's 404)."""
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return b"cadence_" in response.read(1 << 20)
    except (OSError, ValueError, http.client.HTTPException):
        return False


def metrics_url(target: str) -> str | None:
    """The /metrics address of a local cadence server started with --metrics-port (with
    `--fronts N`, front 0's, which shows every front's).

    The port comes from front 0's command line; with `--metrics-port 0` (a port the server
    picked), it is the one of front 0's other listening ports that serves cadence's metrics
    page: a server with `--http-port` listens on a third port, so "the other port" is not
    enough.
    """
    front = _front_zero(target)
    port = None
    if front is not None:
        port = _metrics_port_arg(front)
        if port is None and front.name() == "envoy":  # --grpc-server native: the flags are
            with contextlib.suppress(psutil.Error):  # those of `cadence serve`, Envoy's parent
                parent = front.parent()
                port = _metrics_port_arg(parent) if parent is not None else None
    if port is None or front is None:
        return None  # another server (its other ports speak other protocols), or no metrics
    listening = [
        conn.laddr
        for conn in front.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN
    ]
    if port:
        return next((f"http://{a.ip}:{a.port}/metrics" for a in listening if a.port == port), None)
    grpc_port = int(target.rpartition(":")[2])
    for address in listening:
        url = f"http://{address.ip}:{address.port}/metrics"
        if address.port != grpc_port and _serves_cadence_metrics(url):
            return url
    return None

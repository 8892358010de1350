"""Where and when a run happened: the `run` key of a bench result, so two results can be told
apart (versions, host, CPUs) and the server's own command line kept beside its figures."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from datetime import datetime

import psutil

from cadence.lab.results import RunInfo


def run_context(started_at: datetime, server_pid: int | None) -> RunInfo:
    """`started_at` (ISO-8601, UTC), the versions, the host, its CPUs, and the command line of
    the server process the lab started or found on this host (None when there is none)."""
    return RunInfo(
        started_at=started_at.isoformat(),
        cadence_version=_version("cadence"),
        grpcio_version=_version("grpcio"),
        python_version=platform.python_version(),
        host=socket.gethostname(),
        cpu_count=os.cpu_count(),
        **_server(server_pid),
    )


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _server(pid: int | None) -> dict:
    """The server's command line; for Envoy (`--grpc-server native`), whose command line is
    its whole generated config, the command line of the `cadence serve` that started it and
    Envoy named with its role instead."""
    if pid is None:
        return {}
    try:
        process = psutil.Process(pid)
        cmdline = process.cmdline()
        if process.name() != "envoy":
            return {"server_cmdline": cmdline or None}
        parent = process.parent()
        serve = parent.cmdline() if parent is not None else []
    except psutil.Error:
        return {}
    return {
        "server_cmdline": serve if "serve" in serve else None,
        "server_process": f"envoy (pid {pid}), serving the gRPC port with the front inside "
        "(--grpc-server native)",
    }

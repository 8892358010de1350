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
        server_cmdline=_cmdline(server_pid),
    )


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cmdline(pid: int | None) -> list[str] | None:
    if pid is None:
        return None
    try:
        return psutil.Process(pid).cmdline() or None
    except psutil.Error:
        return None

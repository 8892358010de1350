"""cadence: stream model output over gRPC from machines with several accelerator cards."""

from __future__ import annotations

__all__ = ["AsyncClient", "Client"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so worker processes do not import grpc just to reach cadence.worker.
    if name in __all__:
        from cadence import client

        return getattr(client, name)
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")

"""cadence: stream model output over gRPC from machines with several accelerator cards."""

from __future__ import annotations

__all__ = [
    "AppContext",
    "AppRequest",
    "AsyncClient",
    "Client",
    "ClientCredentials",
    "Model",
    "Sampling",
    "Sequence",
    "SequenceError",
    "StepModel",
    "serve",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so worker processes do not import grpc just to reach cadence.worker.
    if name in ("AsyncClient", "Client"):
        from cadence import client

        return getattr(client, name)
    if name == "ClientCredentials":
        from cadence.credentials import ClientCredentials

        return ClientCredentials
    if name == "serve":
        from cadence.serving import serve

        return serve
    if name in ("Sequence", "SequenceError"):  # a batched model's step (docs/models.md)
        from cadence.engines import base

        return getattr(base, name)
    if name in ("Model", "StepModel"):  # a batched model's declaration (docs/models.md)
        from cadence.engines import model_api

        return getattr(model_api, name)
    if name == "Sampling":  # what Sequence.sampling and AppRequest.sampling hold
        from cadence.vocabulary import Sampling

        return Sampling
    if name in ("AppContext", "AppRequest"):
        from cadence.engines import app

        return getattr(app, name)
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")

"""Admission control and the choice of worker for each request."""

from cadence.router.admission import AdmissionGate
from cadence.router.worker_router import WorkerRouter

__all__ = ["AdmissionGate", "WorkerRouter"]

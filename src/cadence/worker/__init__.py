"""The worker: one process per card (or tensor-parallel group) running the batching loop."""

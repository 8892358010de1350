"""The front: the gRPC service, per-request buffers and the output reader."""

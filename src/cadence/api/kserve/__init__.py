"""The Open Inference Protocol (KServe v2 / Triton gRPC): stubs, the model, the servicer."""

"""The Open Inference Protocol's (KServe v2 / Triton gRPC) stubs, generated from
proto/inference/ into a private descriptor pool (`pool.py`), and its tensors' byte layout
(`tensors.py`)."""

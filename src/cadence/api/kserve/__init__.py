"""The Open Inference Protocol (KServe v2 / Triton gRPC): the model (`model.py`: tensors <->
the core's request), the servicer (`service.py`) and its responses (`responses.py`); its stubs
and tensor layout are `cadence.proto.kserve`'s."""

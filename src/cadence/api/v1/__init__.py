"""cadence.v1.Inference: `service.py` maps its messages (`cadence.proto.v1`) to the core."""

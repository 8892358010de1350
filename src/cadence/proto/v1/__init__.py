"""cadence.v1.Inference's stubs, generated from proto/cadence/v1/inference.proto."""

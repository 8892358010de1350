"""The protocol adapters, wire <-> core and nothing else: `v1/` (cadence.v1.Inference),
`kserve/` (the Open Inference Protocol), `openai/` (the OpenAI HTTP API); `errors.py` maps each
failure to every protocol's status, `security.py` checks a call's token. The stubs they map
from are `cadence.proto`'s; the core they map to is `cadence.core`."""

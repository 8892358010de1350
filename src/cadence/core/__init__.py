"""The front's protocol-agnostic core, in the order a request meets it: `requests.py` (the
domain request and chunk), `generation.py` (validation, admission, routing, the per-request
`Generation`), `stream.py` (the per-request buffer and its overflow policy),
`output_reader.py` (worker output into the buffers), `errors.py`, `metrics.py`."""

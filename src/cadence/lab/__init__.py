"""The latency lab, beside the server and never inside it: `bench.py`, `sweep.py`, `capacity.py`
and their CLIs on top of `load/` (the load generator: plans, one driver per protocol, client
processes), `measure/` (what is read from the server and the host while a run lasts),
`records.py` (the raw per-request records) and `results.py` (the typed results and their JSON
keys), `analysis/` (aggregates and diagnosis from records and results), `report/` (terminal
summary, HTML report, plots) and `servers/` (the servers the lab starts)."""

"""The latency lab, beside the server and never inside it: `bench.py`, `sweep.py`, `capacity.py`
and their CLIs on top of `load/` (the load generator: plans, one driver per protocol, client
processes), `measure/` (what is read from the server and the host while a run lasts),
`analysis/` (aggregates and diagnosis from records and results), `report/` (terminal summary,
HTML report, plots) and `servers/` (the servers the lab starts). The stages run one way, load ->
measure -> analysis -> report, over what they share below them: `records.py` (the raw
per-request records), `results.py` (the typed results and their JSON keys), `percentile.py`
and `scraped_keys.py` (tests/unit/lab/test_lab_layers.py)."""

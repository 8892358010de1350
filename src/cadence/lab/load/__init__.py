"""The load generator: what to send (`plan.py`, `target.py`), one driver per protocol, the client
processes that send and record (`processes.py`, `recording.py`). It writes `cadence.lab.records`;
nothing in the analysis imports it."""

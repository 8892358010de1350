"""Servers the lab starts: `cadence serve` as a child process, a server from the user's command
line, the readiness check, and the engine-only baseline (`baseline.py`: the bench's workload
through the engine alone, no front)."""

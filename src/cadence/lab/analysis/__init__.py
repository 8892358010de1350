"""What the lab concludes after a run, from `cadence.lab.records` and the measurements alone:
aggregates (`stats.py`), integrity, goodput, the streams' timeline, the verdict, and the
diagnosis (`diagnosis/`: its rules)."""

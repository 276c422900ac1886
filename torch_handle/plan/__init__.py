"""Answers before a run: memory estimates, collective bandwidth, scaling sweeps."""

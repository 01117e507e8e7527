"""Benchmarks: the sweep harness and its reports (sweep/), the one-off
studies (studies/), the engines compared (backends/), and the text helpers
of their reports and scripts (tables.py)."""

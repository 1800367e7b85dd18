"""Benchmarks behind `rlpad bench`: each prints a table and returns/writes JSON."""

"""Benchmarks behind `rlpad bench`: each prints a table and returns/writes JSON. The benchmarks' room
sits above the library and the workers; those that need Ray reach it through workers/ only."""

"""Benchmarks (not part of the installed package): one harness per op plus ``make demo``."""

"""Benchmarks: the served load generator, the offline comparison, and the metrics both report."""

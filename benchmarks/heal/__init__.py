"""Heal throughput by state size and transport (docs/benchmarks.md, *Heal throughput*)."""

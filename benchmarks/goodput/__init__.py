"""Goodput and recovery under a kill schedule, against torchrun restarts (docs/benchmarks.md, *Goodput*)."""

"""What exactly-once data costs (docs/benchmarks.md, *Exactly-once data*)."""

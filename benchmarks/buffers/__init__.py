"""What averaging buffers costs (docs/benchmarks.md, *Buffers*)."""

"""Many SIGKILLs from the fault-schedule generator on jobs of many groups, every path (docs/benchmarks.md, *Soak*)."""

"""The survivors' stall over many kills, per training path and kill point (docs/benchmarks.md, *Recovery*)."""

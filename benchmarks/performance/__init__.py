"""Every figure of make bench against its target, and the cluster-scale model (docs/benchmarks.md)."""

"""What grows with the number of replica groups (docs/benchmarks.md, *Many replica groups*)."""

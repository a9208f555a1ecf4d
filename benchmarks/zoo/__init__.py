"""Per-step cost over a zoo of models, and torchft's protocol floor (docs/benchmarks.md, *Zoo*)."""

"""The fault test matrix with its measured figures (docs/reliability.md)."""

"""Bytes and held-out loss of ddp, LocalSGD and DiLoCo (docs/benchmarks.md, *Semi-synchronous training*)."""

"""One GPU: FTStrategy against no fault tolerance and DDPStrategy (docs/benchmarks.md, *One sync per step*)."""

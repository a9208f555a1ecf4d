"""Step time and memory of FTStrategy against DDPStrategy (docs/benchmarks.md, *Step time and memory*)."""

"""Code the benchmark drivers share: running jobs, naming results and recording the machine, the models."""

# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-extra compat test-repeat lint format clean bench bench-semi-sync bench-zoo bench-scale bench-buffers bench-gpu fault-matrix

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, from the pinned CPU build, so nothing pulls a CUDA wheel.
	$(BIN)/pip install --quiet -c constraints.txt torch
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -m "not soak and not scale and not control and not paths" --durations=25 tests

# Outside `make test` (which stays under 20 minutes on 2 cores), and run by CI after it: many replica groups at once
# (8 groups, simultaneous kills), the control run of the exactly-once test (the default sampler loses samples in the
# same scenario), and the soak (20 random kills of 3 groups).
test-extra: $(STAMP)
	$(BIN)/python -m pytest -m "scale or control or soak or paths" --durations=5 tests

# The compatibility matrix (docs/compatibility.md): torchft's next API (torchft-nightly) and torch 2.15, each in an
# environment of its own built from the registry (.venv-<name>). Example: make compat ARGS="torchft-next"
compat:
	.ci/compat $(ARGS)

# The suite N times, optionally beside busy loops; every run is appended to tests/records/suite_runs.jsonl.
# Example: make test-repeat ARGS="--runs 3 --busy 2"
test-repeat: $(STAMP)
	$(BIN)/python tests/repeat.py $(ARGS)

# The performance benchmarks of docs/benchmarks.md: step time and memory against DDPStrategy, heal throughput, goodput
# and recovery against torchrun restarts, the cluster-scale model, and the table and plot of every figure against its
# target. About 12 minutes on 2 CPU cores; run it on an otherwise idle machine.
bench: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/heal_throughput.py
	$(BIN)/python benchmarks/goodput.py
	$(BIN)/python benchmarks/cluster_model.py
	$(BIN)/python benchmarks/report.py

# The semi-synchronous benchmark (docs/benchmarks.md): about 15 minutes per seed on 2 CPU cores.
# Extra arguments: make bench-semi-sync ARGS="--seeds 0 1"
bench-semi-sync: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python benchmarks/semi_sync.py $(ARGS)

# The step-time zoo of docs/benchmarks.md section 6: 9 models x accumulation 1 and 4, 3 repetitions, about 36 minutes.
bench-zoo: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python benchmarks/zoo.py $(ARGS)
	$(BIN)/python benchmarks/protocol_floor.py

# Many groups (docs/benchmarks.md section 7): N = 2..16 real groups, kills at N = 4..16, 1,000 simulated groups
# and k heals at once (about 30 minutes), then the plot of every kept run.
bench-scale: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python benchmarks/scale.py
	$(BIN)/python benchmarks/scale_kills.py
	$(BIN)/python benchmarks/lighthouse_scale.py
	$(BIN)/python benchmarks/heal_fanout.py
	$(BIN)/python benchmarks/scale_plot.py

# What averaging buffers costs (docs/benchmarks.md, Buffers): buffer_sync="average" against "off", about 4 minutes.
bench-buffers: $(STAMP)
	$(BIN)/python benchmarks/buffers.py $(ARGS)

# One GPU (docs/benchmarks.md, One sync per step): FTStrategy against no fault tolerance and DDPStrategy, fp32 and
# bf16-mixed, 10 ms and 100 ms steps, GPU idle, a 1 GB CUDA heal; under 5 minutes. Installs nothing: it runs with the
# machine's own python (a lent GPU machine has no network; docs/benchmarks.md says which wheels travel).
bench-gpu:
	python3 benchmarks/gpu_step.py $(ARGS)

# The fault test matrix with its measured figures (docs/reliability.md): about 10 minutes on 2 CPU cores.
# ARGS="--soak" adds the 20-kill soak run.
fault-matrix: $(STAMP)
	$(BIN)/python benchmarks/fault_matrix.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

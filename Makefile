# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs-check test-extra compat test-repeat lightning-suite lint format clean bench bench-semi-sync bench-zoo bench-scale bench-buffers \
    bench-gpu bench-kill-loop bench-data-modes bench-smoke fault-matrix docs docs-screenshot

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, from the pinned CPU build, so nothing pulls a CUDA wheel.
	$(BIN)/pip install --quiet -c constraints.txt torch
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# Every command of README.md and docs/quickstart.md typed as a user would, in a fresh clone of the committed HEAD
# (uncommitted changes are not checked: ARGS="--source ." checks the working tree) and a fresh venv, stopping at the
# first that fails with its file, line and output. It needs no .venv (the machine's python3, standard library only);
# a block is skipped only with a `<!-- docs-check: skip: REASON -->` before it. About 3 minutes on 2 CPU cores.
docs-check:
	$(PYTHON) .ci/docs_check.py $(ARGS)

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

# Lightning's own tests, as they are and under FTStrategy (docs/lightning-compatibility.md), with the record of what
# differs in tests/records/lightning_suite/. LIGHTNING_TESTS: the tests/ folder of Lightning's sources at the installed
# version's tag, brought in by hand (CI has no network). About 15 minutes on 2 CPU cores.
# Example: make lightning-suite LIGHTNING_TESTS=../pytorch-lightning/tests ARGS="--source-tag 2.6.5"
lightning-suite: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[lightning-suite]"
	$(BIN)/python tests/lightning_suite/run.py --lightning-tests $(LIGHTNING_TESTS) $(ARGS)

# The benchmarks (docs/benchmarks.md; benchmarks/README.md maps every table to its target, results and renderer). Each
# driver is a module run from the repository root, `python -m benchmarks.<section>.<driver>`, and writes a new file
# benchmarks/results/<section>/<UTC>_<commit>.json with the machine inside.
# `make bench`: step time and memory against DDPStrategy, heal throughput, goodput and recovery against torchrun
# restarts, the cluster-scale model, and the table and plot of every figure against its target. About 12 minutes on
# 2 CPU cores; run it on an otherwise idle machine.
bench: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python -m benchmarks.overhead.overhead
	$(BIN)/python -m benchmarks.heal.heal_throughput
	$(BIN)/python -m benchmarks.goodput.goodput
	$(BIN)/python -m benchmarks.performance.cluster_model
	$(BIN)/python -m benchmarks.performance.report

# The semi-synchronous benchmark (docs/benchmarks.md): about 15 minutes per seed on 2 CPU cores.
# Extra arguments: make bench-semi-sync ARGS="--seeds 0 1"
bench-semi-sync: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python -m benchmarks.semi_sync.semi_sync $(ARGS)

# The step-time zoo (docs/benchmarks.md, Per-step cost over a zoo of models): 9 models x accumulation 1 and 4,
# 3 repetitions, about 36 minutes; then torchft's protocol floor.
bench-zoo: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python -m benchmarks.zoo.zoo $(ARGS)
	$(BIN)/python -m benchmarks.zoo.protocol_floor

# Many groups (docs/benchmarks.md, Many replica groups): N = 2..16 real groups, kills at N = 4..16, 1,000 simulated
# groups and k heals at once (about 30 minutes), then the plot of every kept run.
bench-scale: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python -m benchmarks.scale.scale
	$(BIN)/python -m benchmarks.scale.scale_kills
	$(BIN)/python -m benchmarks.scale.lighthouse_scale
	$(BIN)/python -m benchmarks.scale.heal_fanout
	$(BIN)/python -m benchmarks.scale.scale_plot

# What averaging buffers costs (docs/benchmarks.md, Buffers): buffer_sync="average" against "off", about 4 minutes.
bench-buffers: $(STAMP)
	$(BIN)/python -m benchmarks.buffers.buffers $(ARGS)

# One GPU (docs/benchmarks.md, One sync per step): FTStrategy against no fault tolerance and DDPStrategy, fp32 and
# bf16-mixed, 10 ms and 100 ms steps, GPU idle, a 1 GB CUDA heal; under 5 minutes. Installs nothing: it runs with the
# machine's own python (a lent GPU machine has no network; benchmarks/README.md says which wheels travel).
bench-gpu:
	python3 -m benchmarks.gpu.gpu_step $(ARGS)

# The survivors' stall over many kills (docs/benchmarks.md, Recovery): 3 groups, one killed after another, about
# 5 minutes for 27 kills on 2 CPU cores. The second campaign's runs: make bench-kill-loop ARGS="--path diloco
# --where mixed --kills 60 --label r2_diloco" (and --path ddp, hsdp); the table: ARGS="--report <files>".
bench-kill-loop: $(STAMP)
	$(BIN)/python -m benchmarks.kill_loop.kill_loop $(ARGS)

# What exactly-once data costs (docs/benchmarks.md, Exactly-once data): 3 data modes x 3 repetitions, about 3 minutes.
bench-data-modes: $(STAMP)
	$(BIN)/python -m benchmarks.data_modes.data_modes $(ARGS)

# The fault test matrix with its measured figures (docs/reliability.md): about 10 minutes on 2 CPU cores.
# ARGS="--soak" adds the 20-kill soak run.
fault-matrix: $(STAMP)
	$(BIN)/python -m benchmarks.fault_matrix.fault_matrix $(ARGS)

# Whether every driver of every target above still runs, each once at its smallest size (figures to a temporary
# folder; the record of which ran goes to benchmarks/results/smoke/): about 15 minutes on 2 CPU cores.
# Example: make bench-smoke ARGS="--only bench-zoo bench-scale"
bench-smoke: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python -m benchmarks.smoke $(ARGS)

# The docs site (mkdocs.yml): the pages of docs/ and the API reference, rendered from the docstrings without importing
# torch or Lightning, into site/; any warning fails the build. CI runs it. NO_MKDOCS_2_WARNING: Material for MkDocs
# prints a notice about its end of life (docs/index.md, The docs site) on every build.
docs: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The built FTStrategy reference page in headless Chromium (Debian's `chromium` package), saved as
# docs/img/api-ftstrategy.png: site/ served on loopback while docs/screenshot.sh takes it.
docs-screenshot: docs
	docs/screenshot.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site

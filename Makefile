# Quick start: `make demo` and `make test`. Both set up .venv on first use.
# `make test-latest` tests the other end of the supported range in .venv-latest: the newest Python 3 that
# pyenv has (3.13) with the newest jax, jaxlib and orbax-checkpoint that pyproject.toml admits.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LATEST_PYTHON_VERSION ?= 3.13.0
LATEST := .venv-latest
LATEST_STAMP := $(LATEST)/.installed
# `make maxtext`: examples/maxtext_lm.py (MaxText's own model and train_step) in its own Python 3.13 environment.
MAXTEXT := .venv-maxtext
MAXTEXT_STAMP := $(MAXTEXT)/.installed
# `make bench-torchft`: tests/benchmarks/bench_vs_torchft.py, TorchFT's side in its own environment (torch, torchft).
TORCHFT := .venv-torchft
TORCHFT_STAMP := $(TORCHFT)/.installed
TORCHFT_PIP_ARGS ?=

.PHONY: demo test test-heavy test-latest test-slurm maxtext maxtext-launch lint slurm bench bench-torchft clean chaos chaos-ray soak docs docs-serve

$(STAMP): pyproject.toml constraints/default.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints/default.txt -e '.[dev]'
	touch $(STAMP)

$(LATEST_STAMP): pyproject.toml
	test -x $(LATEST)/bin/python || { py="$$(.ci/latest-python $(LATEST_PYTHON_VERSION))" && "$$py" -m venv $(LATEST); }
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[dev]' \
		jax jaxlib orbax-checkpoint
	$(LATEST)/bin/python -c 'import sys, jax, jaxlib, orbax.checkpoint as o; \
		print("latest env: Python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", \
		jaxlib.__version__, "orbax-checkpoint", o.__version__)'
	touch $(LATEST_STAMP)

# Every version pinned in constraints/maxtext.txt (MaxText declares no dependencies of its own: about 1.3 GB).
$(MAXTEXT_STAMP): pyproject.toml constraints/maxtext.txt
	test -x $(MAXTEXT)/bin/python || { py="$$(.ci/latest-python $(LATEST_PYTHON_VERSION))" && "$$py" -m venv $(MAXTEXT); }
	$(MAXTEXT)/bin/python -m pip install --quiet --upgrade pip
	$(MAXTEXT)/bin/python -m pip install --quiet -r constraints/maxtext.txt -e '.[flax]'
	touch $(MAXTEXT_STAMP)

# Only the benchmark's TorchFT workers run here: torch (CPU), torchft and numpy, not this project.
$(TORCHFT_STAMP): constraints/torchft.txt
	test -x $(TORCHFT)/bin/python || $(PYTHON) -m venv $(TORCHFT)
	$(TORCHFT)/bin/python -m pip install --quiet --upgrade pip
	$(TORCHFT)/bin/python -m pip install --quiet $(TORCHFT_PIP_ARGS) -r constraints/torchft.txt
	touch $(TORCHFT_STAMP)

demo: $(STAMP)
	$(BIN)/elastic-runtime demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The SLURM daemons and clients of tests/multiprocess/test_slurm.py (slurm-wlm, munge), when missing. Where they
# cannot be installed (no root, no apt-get) that test skips, saying why; .ci/run installs them first and fails.
slurm:
	@.ci/install-slurm || echo "make: slurm-wlm not installed; tests/multiprocess/test_slurm.py will skip"

test: lint
	$(BIN)/pytest

# The tests of a minute or more each (marked `heavy`: simulated hosts drained for maintenance or lost as a rack, the
# hosts demo, a state larger than a worker's memory, a removed Ray node, a worker's SIGTERM, the GPU campaign's dry
# run), apart from `make test` to keep it under 20 minutes.
# .ci/run calls both.
test-heavy: $(STAMP)
	$(BIN)/pytest -m heavy

# The real SLURM cluster's tests (minutes: a multi-node SLURM on simulated hosts), apart from `make test`.
test-slurm: $(STAMP) slurm
	$(BIN)/pytest -m slurm tests/multiprocess/test_slurm.py

# Lint and mypy run once, in `make test`; this runs, on the newest JAX, jaxlib, orbax-checkpoint and flax, the tests
# whose outcome depends on them: JAX's private entry points (runtime/compat), compiling and tracing under a mesh,
# serialized executables, the RAM snapshot, a lost slice in one process, the state's fingerprint (shard_map) and the
# step's metrics, Orbax's format, the flax example, and
# multi-process groups re-forming (jax.distributed, gloo, shard_map, kept programs, a generation given up). The
# rest (the bus, events, config, the controller's decisions, notices, docs) is plain Python that `make test`
# covers once. LATEST_TESTS=tests runs everything.
LATEST_TESTS ?= tests/test_compat.py tests/test_compiler.py tests/test_same_shape.py tests/test_compile_cache.py tests/test_real_model_shape.py \
	tests/test_ram.py tests/test_spares.py tests/test_flax_lm.py tests/test_integrity.py tests/test_metrics.py tests/checkpoints \
	tests/multiprocess/test_real_model_launch.py tests/multiprocess/test_slices.py tests/multiprocess/test_given_up.py
test-latest: $(LATEST_STAMP)
	$(LATEST)/bin/pytest $(LATEST_TESTS)

# A short check of examples/maxtext_lm.py in one process: 12 steps, slice 3 lost at step 6, 0 steps lost and the
# state within 1e-5 of a fault-free run (--check exits 1 otherwise). Background compiles of the degraded meshes
# are off (each MaxText compile takes 40-90 s on 2 cores; there would be four more): the recovery waits for one.
# `timeout`: a guard; the example's step hung for good in XLA:CPU collectives while its layers were scanned
# (docs/maxtext.md, "The hang, found").
maxtext: $(MAXTEXT_STAMP)
	rm -rf runs/maxtext-check  # a fresh run each time: the runtime refuses to start over an earlier run's checkpoints
	timeout 1200 $(MAXTEXT)/bin/python examples/maxtext_lm.py --steps 12 --lose-slice-at 6 --no-precompile --check \
		--json --run-dir runs/maxtext-check

# MaxText's own model under launch --nprocs 4 --slices 1 --durable: a worker killed at step 12 and its replica
# files deleted, its quarter of the state read back from the durable tier, the result bitwise equal to a
# fault-free run of the same layout. Both are in .ci/run.
maxtext-launch: $(MAXTEXT_STAMP)
	timeout 2400 $(MAXTEXT)/bin/python tests/benchmarks/bench_real_recovery.py --models maxtext --durable --check \
		--steps 30 --kill-at 12

bench: $(STAMP)
	$(BIN)/python tests/benchmarks/run_all.py

# Against TorchFT (docs/benchmarks.md): the demo MLP, 3 workers, kill -9 of one at step 20, in both systems,
# REPEATS interleaved runs of each (minutes). Not part of `make bench` or `make test`.
bench-torchft: $(STAMP) $(TORCHFT_STAMP)
	$(BIN)/python tests/benchmarks/bench_vs_torchft.py --torchft-python $(TORCHFT)/bin/python --repeats $(or $(REPEATS),5)

# Multi-process chaos loop: random kill -9 / SIGSTOP of real worker processes, checked bitwise.
chaos: $(STAMP)
	$(BIN)/python tests/multiprocess/chaos.py --rounds $(or $(ROUNDS),10)

# The soak campaign (tests/benchmarks/soak.py): seeded rounds of every fault kind, one process and multi-process, each
# checked against a fault-free run, until FAULTS faults were injected (hours for 1000 on 2 cores) or MINUTES passed.
# The last line is JSON; a failed round's seed replays it (--round SEED). .ci/run runs a short one.
soak: $(STAMP)
	$(BIN)/python tests/benchmarks/soak.py --faults $(or $(FAULTS),1000) --seed $(or $(SEED),1) $(if $(MINUTES),--minutes $(MINUTES))

# Ray: a node of a local multi-node Ray test cluster removed in each of ROUNDS runs (tests/benchmarks/bench_ray.py).
chaos-ray: $(STAMP)
	$(BIN)/python tests/benchmarks/bench_ray.py --only elastic --repeats $(or $(ROUNDS),5)

# The docs site (mkdocs.yml), built strictly: a broken link, a page missing from the nav or a public name
# without a docstring fails the build.
docs: $(STAMP)
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) $(LATEST) $(MAXTEXT) $(TORCHFT) site runs .pytest_cache .mypy_cache .ruff_cache .import_linter_cache

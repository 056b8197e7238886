# The README names these targets; each installs what it needs into .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Azurite (the Azure Storage emulator) for the storage tests: an exact version, installed by npm
# from its lock file into a gitignored node_modules next to it.
AZURITE_DIR := tests/storage/azurite
AZURITE := $(AZURITE_DIR)/node_modules/.bin/azurite-blob

.PHONY: test lint typecheck pytest check-java check-node azurite bench clean demo

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,spark,bench,cli]'
	@touch $(STAMP)

check-java:
	@java -version >/dev/null 2>&1 || { \
	  echo "Java 17 is required for the Spark layer and its tests, and 'java' was not found."; \
	  echo "Install it (Debian/Ubuntu: apt-get install openjdk-17-jre-headless) and retry."; \
	  exit 1; }

check-node:
	@npm --version >/dev/null 2>&1 || { \
	  echo "node and npm are required to install Azurite, the Azure emulator of the storage tests,"; \
	  echo "and 'npm' was not found. Install them (Debian/Ubuntu: apt-get install nodejs npm) and retry."; \
	  exit 1; }

$(AZURITE): $(AZURITE_DIR)/package.json $(AZURITE_DIR)/package-lock.json | check-node
	npm ci --prefix $(AZURITE_DIR) --no-audit --no-fund --loglevel=error
	@touch $(AZURITE)

azurite: $(AZURITE)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) $(AZURITE) check-java
	PYSPARK_PYTHON=$(abspath $(BIN)/python) $(BIN)/python -m pytest --durations=25

test: lint typecheck pytest

# The demo pipeline (Spark streaming, a hard crash, restores, an equality check); pass
# options with DEMO_ARGS, e.g. make demo DEMO_ARGS="--keys 20000 --batches 12".
demo: $(STAMP) check-java
	PYSPARK_PYTHON=$(abspath $(BIN)/python) $(BIN)/statekeeper demo $(DEMO_ARGS)

# Sizes that finish in about 25 minutes on 2 cores. Spark's own Python state operators cost
# about 0.2-0.7 ms per key there, so they run 3 of the pipeline's 100k-row batches. The timers
# benchmark adds its 10M-timer store's build (25 minutes at load average 20).
bench: $(STAMP) check-java
	$(BIN)/python benchmarks/commit.py --sizes 100000 1000000 --commits 40 --out benchmarks/results/commit.json
	$(BIN)/python benchmarks/restore.py --keys 1000000 --versions 20 --tail 5 --out benchmarks/results/restore.json
	$(BIN)/python benchmarks/longrun.py --commits 5000 --window 1000 --out benchmarks/results/longrun.json
	$(BIN)/python benchmarks/per_key.py --keys 100000 --repeat 3 --arrow-rows 100000 1000000 --out benchmarks/results/per_key.json
	$(BIN)/python benchmarks/pipeline.py --rows 100000 --keys 1000000 --batches 10 --peer-batches 3 --out benchmarks/results/pipeline.json
	$(BIN)/python benchmarks/timers.py --timers 1000000 10000000 --due 10000 --batches 20 --out benchmarks/results/timers.json
	$(BIN)/python benchmarks/report.py --results benchmarks/results --out benchmarks/RESULTS.md

# Deterministic simulation of the commit protocol (tests/sim): SEEDS seeds of every scenario
# in one worker process per core, a summary table, and a one-line reproduction per failing
# seed (make test runs 170 seeds of each, 3060 in all, in 2 workers). Options
# go in SOAK_ARGS, e.g. make soak SEEDS=200 SOAK_ARGS="--first 0 --jobs 2".
# Then the randomized fault suites (tests/faults: SIGKILL, corruption of every blob kind, S3
# through a failing proxy), FAULT_SEEDS trials each (a few seconds a trial); options in
# FAULT_ARGS, e.g. make soak SEEDS=200 FAULT_SEEDS=20 FAULT_ARGS="--first 0 --suite s3".
.PHONY: soak
SEEDS ?= 1000
FAULT_SEEDS ?= $(SEEDS)
soak: $(STAMP)
	$(BIN)/python -m tests.sim --soak $(SEEDS) $(SOAK_ARGS)
	$(BIN)/python -m tests.faults --seeds $(FAULT_SEEDS) $(FAULT_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
	rm -rf $(AZURITE_DIR)/node_modules

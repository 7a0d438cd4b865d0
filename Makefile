# The two commands a new machine needs (see README):
#   make serve  set up, convert the demo model once, and serve it (kvtier serve)
#   make test   set up and run the test suite (what .ci/run calls)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: speculators-venv setup serve demo test test-all bench-throughput bench-policies bench-offload bench-serve bench-hidden-states soak gpu-wheels gpu-check

setup:
	@PYTHON=$(PY) VENV=$(VENV) bash scripts/setup.sh

serve: setup
	$(BIN)/kvtier serve

# One question to the demo model, offline.
demo: setup
	$(BIN)/kvtier generate --chat "What is the capital of France?" --max-tokens 32

test: setup
	$(BIN)/python -m pytest

# speculators 0.9.0 in its own venv (.venv-speculators, ~2.5 min and 1.5 GB once): the oracle that
# tests/server/test_speculators_oracle.py runs when it exists.
speculators-venv:
	@PYTHON=$(PY) bash scripts/speculators-venv.sh

# Includes the slow tests (the real demo model end to end).
test-all: setup
	$(BIN)/python -m pytest -m "slow or not slow"

bench-throughput: setup
	$(BIN)/python benchmarks/throughput.py

bench-policies: setup
	$(BIN)/python benchmarks/policies.py

bench-offload: setup
	$(BIN)/python benchmarks/offload.py --runs 3

# Two `kvtier serve` subprocesses, offload off vs on, on a slice of the Mooncake trace (~10 min).
bench-serve: setup
	$(BIN)/python benchmarks/serve.py --runs 3

bench-hidden-states: setup
	$(BIN)/python benchmarks/hidden_states.py

# Fault campaign (~10 min + the oracle): kvtier serve with G2, G3 and G4 while a chaos thread kills
# the engine core, stops and kills Redis, fills G3, makes it read-only and flips bytes in it;
# every output is checked against a clean server's. Exit 1 on a wrong output. Root for the mounts.
soak: setup
	$(BIN)/python benchmarks/soak.py

# The GPU path on a CUDA machine (issue 14). gpu-wheels runs on a networked machine and fills .whl/
# with the dependencies the offline GPU machine's python lacks; gpu-check runs there (see the script).
gpu-wheels: setup
	bash scripts/gpu-wheels.sh

gpu-check:
	bash scripts/gpu-check.sh

# The two commands a new machine needs (see README):
#   make serve  set up, convert the demo model once, and serve it (kvtier serve)
#   make test   set up and run the test suite (what .ci/run calls)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: speculators-venv setup serve demo test test-all bench-setup bench-throughput bench-policies bench-offload bench-serve bench-serve-policies bench-fleet bench-hidden-states soak gpu-wheels gpu-check

setup:
	@PYTHON=$(PY) VENV=$(VENV) bash scripts/setup.sh

serve: setup
	$(BIN)/kvtier serve

# One question to the demo model, offline.
demo: setup
	$(BIN)/kvtier generate --chat "What is the capital of France?" --max-tokens 32

# Two pytest workers by default (this project's CI machine has 2 cores); a test file's tests stay
# on one worker, so a module's server fixture starts once, and the longest files start first
# (tests/file_order.py). TEST_WORKERS=0 runs them in-process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# speculators 0.9.0 in its own venv (.venv-speculators, ~2.5 min and 1.5 GB once): the oracle that
# tests/server/test_speculators_oracle.py runs when it exists.
speculators-venv:
	@PYTHON=$(PY) bash scripts/speculators-venv.sh

# Includes the slow tests (the real demo model end to end).
test-all: setup
	$(BIN)/python -m pytest -m "slow or not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The benchmarks draw a PNG beside their JSON (benchmarks/_plots.py) with matplotlib, the `bench`
# extra: installed here, not by `setup`, so `make test` never needs it. Each bench-* target then
# copies its fresh PNG to docs/plots/, where the README shows it.
bench-setup: setup
	@$(BIN)/python -c "import matplotlib" 2>/dev/null \
	  || { echo "bench-setup: installing the bench extra (matplotlib)"; \
	       $(BIN)/python -m pip install --disable-pip-version-check -q -e ".[bench]"; }

publish_plot = @mkdir -p docs/plots && cp benchmarks/results/$(1).png docs/plots/$(1).png && echo "copied $(1).png to docs/plots/"

# vLLM's CPU build joins when VLLM_PYTHON names its venv's python (../shared/PEERS.md), e.g.
#   make bench-throughput VLLM_PYTHON=/tmp/vllmvenv/bin/python VLLM_ENV=LD_PRELOAD=.../libtcmalloc_minimal.so.4
bench-throughput: bench-setup
	$(BIN)/python benchmarks/throughput.py $(BENCH_THROUGHPUT_ARGS) $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON)) $(if $(VLLM_ENV),--vllm-env $(VLLM_ENV))
	$(call publish_plot,throughput)

# The capacities of the README's "Choosing an eviction policy" table.
bench-policies: bench-setup
	$(BIN)/python benchmarks/policies.py --capacities 2048,4096,8192,16384,32768,65536
	$(call publish_plot,policies)

bench-offload: bench-setup
	$(BIN)/python benchmarks/offload.py --runs 3
	$(call publish_plot,offload)

# Two `kvtier serve` subprocesses, offload off vs on, on a slice of the Mooncake trace (~10 min).
bench-serve: bench-setup
	$(BIN)/python benchmarks/serve.py --runs 3
	$(call publish_plot,serve)

# `kvtier serve` with lru vs turn_lru in G1 and G2 on a multi-turn slice (~15 min).
bench-serve-policies: bench-setup
	$(BIN)/python benchmarks/serve_policies.py
	$(call publish_plot,serve_policies)

# Routing a fleet: two `kvtier serve` replicas behind vllm-router, a 3-node Redis Cluster as G4;
# round_robin without and with G4, cache_aware, kv_aware (KV events) and prefill/decode split (~11 min).
bench-fleet: bench-setup
	$(BIN)/python benchmarks/fleet.py
	$(call publish_plot,fleet)

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

#!/usr/bin/env bash
# The GPU path end to end on a bare CUDA machine whose python3 already has torch, triton,
# transformers and pytest, with no network (issue 14):
#   1. installs the project's other dependencies from a local wheel folder ($WHEELS, default .whl,
#      made by `make gpu-wheels` on a networked machine) into a private target, when present;
#   2. pytest: the Triton kernels on the GPU (tests/kernels), the engine on CUDA (`-m gpu`), and
#      the transformers parity suite with the engine on CUDA (KVTIER_TEST_DEVICE=cuda);
#   3. benchmarks/gpu.py on a random Llama-3-8B-shaped model in bf16 (written once, no download);
#   4. benchmarks/async_scheduling.py on that model: sync against --async-scheduling (issue 42).
# Everything lands in $OUT (default benchmarks/results/gpu-check): logs, and gpu-check.json with
# each step's status and the benchmark's figures. Exit status: 0 when every test step passed.
# For a short lease: STEP_TIMEOUT (seconds per step, default none), PARITY_K (a pytest -k filter
# for the parity step, e.g. "eager or llama"), GPU_TESTS_K (the same for the tests/gpu step), BENCH_ARGS (extra benchmarks/gpu.py arguments),
# BENCH_TIMEOUT (seconds for the benchmark and async-scheduling steps, default STEP_TIMEOUT),
# ASYNC_ARGS (extra benchmarks/async_scheduling.py arguments), SKIP (steps not to run,
# e.g. "kernel-tests parity-cuda"; a skipped step is -1 in gpu-check.json and does not fail the run).
set -uo pipefail
cd "$(dirname "$0")/.."
for s in ${SKIP:-}; do  # a misspelt step would otherwise run after all
  case $s in kernel-tests|gpu-tests|parity-cuda|benchmark|async-scheduling) ;; *)
    echo "gpu-check: SKIP names an unknown step '$s' (steps: kernel-tests gpu-tests parity-cuda benchmark async-scheduling)"; exit 2;;
  esac
done
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/results/gpu-check}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee "$OUT_DIR/device.txt" || { echo "gpu-check: no usable CUDA python"; exit 1; }
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  site=$(mktemp -d /tmp/kvtier-site.XXXXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl \
    || { echo "gpu-check: installing $WHEELS failed"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu-check: installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
else
  echo "gpu-check: no wheels in $WHEELS (make gpu-wheels); using what $PY has"
fi
declare -A status
run_step() {  # name, then the command; its output goes to $OUT_DIR/<name>.log
  local name=$1; shift
  if [[ " ${SKIP:-} " == *" $name "* ]]; then status[$name]=-1; echo "== $name: skipped"; return; fi
  echo "== $name: $*"
  local limit=${STEP_TIMEOUT:-}
  if [ "$name" = benchmark ] || [ "$name" = async-scheduling ]; then limit=${BENCH_TIMEOUT:-$limit}; fi
  if [ -n "$limit" ]; then set -- timeout -k 10 "$limit" "$@"; fi
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  status[$name]=${PIPESTATUS[0]}
  echo "== $name: exit ${status[$name]}"
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --durations=10 -o addopts=)
run_step kernel-tests "${PYTEST[@]}" tests/kernels
run_step gpu-tests "${PYTEST[@]}" -m gpu ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} tests/gpu
run_step parity-cuda env KVTIER_TEST_DEVICE=cuda "${PYTEST[@]}" ${PARITY_K:+-k "$PARITY_K"} tests/engine/test_parity.py
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
run_step benchmark "$PY" benchmarks/gpu.py --out "$OUT_DIR/benchmark.json" ${BENCH_ARGS:-}
# The benchmark step's model (written there once); both engines live in one process, 0.4 of the GPU each.
MODEL_8B=$("$PY" -c 'from engine.cache_dir import cache_root; print(cache_root() / "gpu-bench-llama3-8b")')
# shellcheck disable=SC2086  # ASYNC_ARGS is a list of arguments
run_step async-scheduling "$PY" benchmarks/async_scheduling.py --model "$MODEL_8B" --gpu-memory-utilization 0.4 \
  --workloads decode64,sampled64,default --out "$OUT_DIR/async.json" ${ASYNC_ARGS:-}
"$PY" - "$OUT_DIR" "kernel-tests=${status[kernel-tests]}" "gpu-tests=${status[gpu-tests]}" \
  "parity-cuda=${status[parity-cuda]}" "benchmark=${status[benchmark]}" \
  "async-scheduling=${status[async-scheduling]}" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
steps = dict(a.split("=") for a in sys.argv[2:])
bench, sched = out / "benchmark.json", out / "async.json"
doc = {"device": (out / "device.txt").read_text().strip(), "steps": {k: int(v) for k, v in steps.items()},
       "benchmark": json.loads(bench.read_text()) if bench.is_file() else None,
       "async_scheduling": json.loads(sched.read_text()) if sched.is_file() else None}
(out / "gpu-check.json").write_text(json.dumps(doc, indent=2))
print(f"gpu-check: {doc['steps']} -> {out / 'gpu-check.json'}")
PYEOF
for s in kernel-tests gpu-tests parity-cuda; do [ "${status[$s]}" -le 0 ] || exit 1; done
exit 0

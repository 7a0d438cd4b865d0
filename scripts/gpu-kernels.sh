#!/usr/bin/env bash
# The Triton kernels on a CUDA machine whose python3 already has torch, triton and pytest (no
# network needed): runs tests/kernels on the GPU, then benchmarks/kernels.py. Logs and the
# benchmark's JSON go to $OUT (default benchmarks/results/). Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null | tee "$OUT_DIR/gpu.txt"
"$PY" -m pytest tests/kernels -q -p no:cacheprovider --durations=15 2>&1 | tee "$OUT_DIR/kernels-tests.log"
status=${PIPESTATUS[0]}
"$PY" benchmarks/kernels.py --copy-to "$OUT_DIR" 2>"$OUT_DIR/kernels-bench.err" | tee "$OUT_DIR/kernels-bench.txt"
bench=${PIPESTATUS[0]}
[ "$bench" -eq 0 ] || { echo "benchmark failed ($bench), see $OUT_DIR/kernels-bench.err"; tail -20 "$OUT_DIR/kernels-bench.err"; }
exit "$status"

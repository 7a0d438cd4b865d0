#!/usr/bin/env bash
# Wheels for scripts/gpu-check.sh on a CUDA machine that cannot reach the network (`make gpu-wheels`).
# That machine's python already has torch, triton, transformers and pytest; this fetches the rest
# the GPU checks import, for CPython $GPU_PY (default 3.12) on manylinux x86-64, into $WHEELS
# (default .whl, git-ignored). Versions are the ones this checkout's .venv runs with.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEELS:-.whl}
PYVER=${GPU_PY:-3.12}
PKGS=(xxhash msgpack msgspec pyzmq redis hiredis hypothesis sortedcontainers)
PIP=(.venv/bin/python -m pip)
[ -x .venv/bin/python ] || PIP=(python3 -m pip)
pins=()
for p in "${PKGS[@]}"; do
  v=$("${PIP[@]}" show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  pins+=("$p${v:+==$v}")
done
mkdir -p "$DEST"
plats=()
for n in 17 24 27 28 31 34; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${plats[@]}" --platform manylinux2014_x86_64 -d "$DEST" "${pins[@]}"
echo "gpu-wheels: $(ls "$DEST"/*.whl | wc -l) wheels in $DEST (${pins[*]})"

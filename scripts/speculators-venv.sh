#!/usr/bin/env bash
# Idempotent: a separate virtualenv with speculators 0.9.0, the oracle for `kvtier extract --layout
# speculators` and `/v1/chat/completions/render` (tests/server/test_speculators_oracle.py uses it
# when present). Separate because speculators pins transformers/datasets ranges of its own.
#   SPECULATORS_VENV (default .venv-speculators), PYTHON (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${SPECULATORS_VENV:-.venv-speculators}
VERSION=0.9.0
if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.speculators-$VERSION" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# torch first, pinned: an open range would pull a multi-GB CUDA build (torchvision/torchaudio too).
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
# speculators requires torchvision and torchaudio (it imports neither): left free, pip takes the newest,
# which needs a newer torch, and replaces the CPU build with a multi-GB CUDA one.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
"${pip[@]}" -c "$constraints" "speculators==$VERSION"
# Their PyPI builds are CUDA builds: with the CPU torch, transformers' import of torchvision fails
# ("operator torchvision::nms does not exist"). Nothing speculators runs here needs them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio
"$VENV/bin/python" -c "import speculators.train.data, speculators.data_generation.preprocessing"
touch "$VENV/.speculators-$VERSION"

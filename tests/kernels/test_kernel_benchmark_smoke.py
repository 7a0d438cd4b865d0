"""benchmarks/kernels.py runs only on a GPU session's machine, so nothing else would notice when a
change elsewhere breaks it (a new DecodeGroup field did, once). Its --smoke mode runs the whole
script at tiny shapes under the interpreter here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_kernel_benchmark_script_runs_in_smoke_mode(device, tmp_path):
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernels.py"), "--smoke", "--copy-to", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in ("decode", "prefill", "kv_write", "gather", "scatter"):
        assert case in proc.stdout
    assert list(tmp_path.glob("kernels-*.json"))

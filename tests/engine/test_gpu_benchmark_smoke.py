"""benchmarks/gpu.py runs only where a GPU is lent, so its --smoke mode runs it here on CPU (tiny
random model, every engine section) to catch a change elsewhere that breaks it. Its kernels section
is benchmarks/kernels.py, smoke-tested in tests/kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_runs_in_smoke_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu",
                           "--sections", "ttft,decode", "--decode-variants", "eager,graphs,graphs-async", "--hf", "eager",
                           "--model-dir", str(tmp_path / "model"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for n in ("64", "200"):
        row = doc["ttft"]["lengths"][n]["median_s"]
        assert all(row[k] > 0 for k in ("cold", "G1", "G2", "G3")), row
    assert doc["ttft"]["lengths"]["200"]["g2_load_GBps"] > 0  # the G2 hit really loaded blocks
    dec = doc["decode"]
    assert set(dec["kvtier"]) == {"eager", "graphs", "graphs-async"} and set(dec["transformers"]) == {"eager"}
    assert set(dec["kvtier"]["graphs-async"]) == set(dec["transformers"]["eager"]) == {"1", "4"}
    assert all(r["tok_s"] > 0 and r["step_ms"] > 0 for v in ("graphs", "graphs-async")
               for r in dec["kvtier"][v].values()), dec
    assert "graphs / best transformers" in proc.stdout


def test_gpu_benchmark_refuses_cpu_without_smoke():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs one" in proc.stderr


def test_gpu_check_refuses_an_unknown_step_to_skip():
    script = REPO / "scripts" / "gpu-check.sh"
    proc = subprocess.run(["bash", str(script)], env={**os.environ, "SKIP": "gpu-tests kernel-test"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "unknown step 'kernel-test'" in proc.stdout, proc.stdout + proc.stderr

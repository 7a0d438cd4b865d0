"""Acceptance 2 (issue 3): G3 survives a restart, with real processes.

Process A fills G3 in a directory D and exits (llm.close() flushes the writes). Process B, a
new process on D, gets G3 hits on the same prompts with outputs identical to offload off.
A different model (same architecture, other weights) and the same model in another dtype
on D get zero hits, and their outputs equal their own offload-off outputs. Control: the
same weights copied to another directory do hit (the fingerprint is the content, not the
path), so the zero-hit results are due to the model identity and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from checkpoints import build_checkpoint
from offload_helpers import G1_BLOCKS, KIND, MAX_TOKENS, OB, hit_tokens, reference, workload

REPO = Path(__file__).resolve().parents[2]
PROMPTS = workload()
EXPECTED_HITS = [hit_tokens(len(p)) for p in PROMPTS]

# Runs each config in `runs` (one LLM after another, in this one process) and prints one
# JSON line with each run's tokens, per-tier cached tokens and tier stats.
CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams
spec = json.loads(sys.argv[1])
results = []
for r in spec["runs"]:
    llm = LLM(r["model"], dtype=r["dtype"], num_gpu_blocks=spec["g1_blocks"], kv_offload_block_size=spec["ob"],
              kv_offload_disk=spec["disk"])
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]],
                        SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True), use_tqdm=False)
    llm.engine.flush_offload()  # G3 writes run on writer threads: count them once they landed
    llm.engine.check_integrity()
    llm.engine.connector.tier("G3").backend.check_integrity()
    tiers = llm.get_stats().tiers
    llm.close()
    results.append({"tokens": [o.outputs[0].token_ids for o in outs],
                    "by_tier": [o.cached_tokens_by_tier for o in outs], "tiers": tiers})
print("RESULT " + json.dumps({"pid": os.getpid(), "results": results}))
"""


def run_process(tmp_path: Path, disk: Path, runs: list[dict]) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    spec = {"runs": runs, "disk": str(disk), "prompts": PROMPTS, "g1_blocks": G1_BLOCKS, "ob": OB,
            "max_tokens": MAX_TOKENS}
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), json.dumps(spec)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def entry_files(disk: Path) -> dict[str, list[Path]]:
    """Namespace directory name -> its entry files."""
    return {ns.name: sorted(ns.glob("*/*.kvb")) for ns in disk.iterdir() if ns.is_dir()}


def test_g3_survives_restart_and_is_namespaced_by_model(ckpt_dir, tmp_path):
    model = ckpt_dir(KIND)
    other = build_checkpoint(KIND, tmp_path / "other_weights", seed=1)
    copy = tmp_path / "same_weights_elsewhere"
    shutil.copytree(model, copy)
    ref = reference(model, PROMPTS)
    ref_other = reference(other, PROMPTS, check_hf=False)
    ref_bf16 = reference(model, PROMPTS, dtype="bfloat16", check_hf=False)
    assert ref_other != ref  # else serving the other model's KV could go unnoticed in its tokens
    disk = tmp_path / "g3"

    proc_a = run_process(tmp_path, disk, [{"model": str(model), "dtype": "float32"}])
    a = proc_a["results"][0]
    assert a["tokens"] == ref
    assert a["by_tier"] == [{}, {}, {}]  # cold
    assert a["tiers"]["G3"]["hit_tokens"] == 0 and a["tiers"]["G3"]["bytes_written"] > 0
    files = entry_files(disk)
    assert len(files) == 1
    (ns_a, written), = files.items()
    assert a["tiers"]["G3"]["entries"] >= sum(EXPECTED_HITS) // OB

    # process B: the same model first, then the other identities, on the same directory
    proc_b = run_process(tmp_path, disk, [
        {"model": str(model), "dtype": "float32"},
        {"model": str(other), "dtype": "float32"},
        {"model": str(model), "dtype": "bfloat16"},
        {"model": str(copy), "dtype": "float32"},
    ])
    assert proc_b["pid"] != proc_a["pid"]
    b, other_run, bf16_run, copy_run = proc_b["results"]
    assert b["tokens"] == ref
    assert b["by_tier"] == [{"G3": n} for n in EXPECTED_HITS]
    assert b["tiers"]["G3"]["hit_tokens"] == sum(EXPECTED_HITS)
    assert b["tiers"]["G3"]["corrupt"] == 0 and b["tiers"]["load_failures"] == 0

    assert other_run["tokens"] == ref_other
    assert other_run["by_tier"] == [{}, {}, {}]
    assert other_run["tiers"]["G3"]["hit_tokens"] == 0 and other_run["tiers"]["G3"]["hits"] == 0
    assert bf16_run["tokens"] == ref_bf16
    assert bf16_run["by_tier"] == [{}, {}, {}]
    assert bf16_run["tiers"]["G3"]["hit_tokens"] == 0 and bf16_run["tiers"]["G3"]["hits"] == 0
    for run in (other_run, bf16_run):  # not even looked up and refused: absent from the index
        assert run["tiers"]["load_failures"] == 0 and run["tiers"]["G3"]["misses"] == 0
    # control: the same weights at another path are the same model
    assert copy_run["tokens"] == ref
    assert copy_run["by_tier"] == [{"G3": n} for n in EXPECTED_HITS]

    # each model identity has its own namespace; A's entries were neither served to nor
    # removed by the other models
    files = entry_files(disk)
    assert len(files) == 3 and ns_a in files
    assert set(written) <= set(files[ns_a])


def test_checkpoint_rewritten_in_place_with_its_stat_restored_gets_a_new_namespace(ckpt_dir, tmp_path):
    """Issue 38, acceptance 3: other weights written over the checkpoint's file in place (same
    inode, same size, mtime put back, as `cp -p` over it or a restored backup leave it) must
    not be served the old weights' G3 KV. Process A hashes the weights (the digest cache is
    then valid: the files are older than its racy window) and fills G3; process B runs on the
    rewritten checkpoint and must get zero hits and its own model's tokens."""
    import time

    from engine.kv.fingerprint import CACHE_NAME, RACY_NS

    model = tmp_path / "model"
    shutil.copytree(ckpt_dir(KIND), model, ignore=shutil.ignore_patterns(CACHE_NAME))
    copied = time.time()
    other = build_checkpoint(KIND, tmp_path / "other_weights", seed=1)
    ref = reference(model, PROMPTS, check_hf=False)
    ref_other = reference(other, PROMPTS, check_hf=False)
    assert ref_other != ref
    time.sleep(max(0.0, copied + RACY_NS / 1e9 + 0.2 - time.time()))  # settled: its digest is cached
    disk = tmp_path / "g3"
    a = run_process(tmp_path, disk, [{"model": str(model), "dtype": "float32"}])["results"][0]
    assert a["tokens"] == ref and a["tiers"]["G3"]["bytes_written"] > 0
    cache = json.loads((model / CACHE_NAME).read_text())
    assert "model.safetensors" in cache["files"]  # B would find a cached digest

    f = model / "model.safetensors"
    before = f.stat()
    new = (other / "model.safetensors").read_bytes()
    assert len(new) == before.st_size
    with open(f, "r+b") as out:  # in place: the same inode
        out.write(new)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = f.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)

    b = run_process(tmp_path, disk, [{"model": str(model), "dtype": "float32"}])["results"][0]
    assert b["tokens"] == ref_other
    assert b["by_tier"] == [{}, {}, {}]
    assert b["tiers"]["G3"]["hit_tokens"] == 0 and b["tiers"]["G3"]["hits"] == 0
    assert len(entry_files(disk)) == 2  # a second namespace beside the old weights'

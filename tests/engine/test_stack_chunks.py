"""The frame-stack chunk cache (engine/runner/stack_chunks.py) against CPython's own allocator: a
loop whose calls cross a chunk's edge faults a fresh chunk in on every call without it, and reuses
one with it. Each side runs in its own process, since installing changes the process for good."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runner import stack_chunks

REPO = Path(__file__).resolve().parents[2]
CALLS = 2000

# Recurses one level at a time; at each depth, counts the page faults of CALLS calls of a function
# with a large frame (300 locals). At the depths where the recursion's small frames still fit in the
# current chunk but that frame does not, every call needs a chunk of its own.
PROBE = f"""
import json, os, resource, sys
from engine.runner import stack_chunks
cache = stack_chunks.install() if os.environ["INSTALL"] == "1" else None
exec("def leaf():\\n    " + " = ".join(f"v{{i}}" for i in range(300)) + " = 0")
def scan(depth, faults):
    if depth == 0:
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({CALLS}):
        leaf()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    scan(depth - 1, faults)
faults = []
scan(400, faults)
c = cache.counts() if cache else None
print(json.dumps({{"max_faults": max(faults), "reused": c and c.reused}}))
"""


def probe(install: bool) -> dict:
    env = {**os.environ, "INSTALL": "1" if install else "0", "PYTHONPATH": str(REPO),
           stack_chunks.ENV: "on"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.implementation.name != "cpython" or sys.version_info < (3, 11),
                    reason="chunked frame stacks are CPython 3.11+")
def test_a_loop_across_a_chunk_edge_reuses_one_chunk_instead_of_faulting_one_in_per_call():
    plain, cached = probe(install=False), probe(install=True)
    if plain["max_faults"] < CALLS:  # an interpreter that caches a chunk itself (gh-142183's fix)
        pytest.skip(f"this CPython does not map a chunk per call ({plain['max_faults']} faults for {CALLS} calls)")
    assert cached["max_faults"] < CALLS // 10, cached
    assert cached["reused"] >= CALLS, cached


def test_the_switch(monkeypatch):
    monkeypatch.setenv(stack_chunks.ENV, "off")
    assert stack_chunks.install.__wrapped__() is None  # CPython's allocator left alone
    monkeypatch.setenv(stack_chunks.ENV, "maybe")
    with pytest.raises(ValueError, match=stack_chunks.ENV):
        stack_chunks.install.__wrapped__()

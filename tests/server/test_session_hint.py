"""A request's `prompt_cache_key` (else its `user`) reaches the tiers' eviction policies as
BlockInfo.session, through a real `kvtier serve` (issue 18: turn_lru needs it)."""
from __future__ import annotations

import json
from pathlib import Path

import checkpoints
from serving import start_server

HERE = Path(__file__).resolve().parent


def test_prompt_cache_key_then_user_reach_the_g1_policy(ckpt_dir, tmp_path):
    log = tmp_path / "sessions.log"
    spec = {"name": "session_log_policy:SessionLog", "options": {"path": str(log)}}
    srv = start_server(str(ckpt_dir("llama")), "--served-model-name", "tiny", "--kv-eviction-policy", json.dumps(spec),
                       "--num-gpu-blocks", "64",
                       env={"PYTHONPATH": f"{HERE.parents[1]}:{HERE}"})
    try:
        prompt = checkpoints.random_prompt(40, seed=5)  # two full 16-token blocks
        for extra in ({"prompt_cache_key": "conv-7", "user": "alice"}, {"user": "alice"}, {}):
            with srv.client(timeout=60) as c:
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
    seen = log.read_text().split()
    # first request: its blocks are cached under conv-7; the second hits them as alice; the third,
    # with no hint, as None. The key wins over `user`.
    assert seen[0] == "conv-7" and "alice" in seen and seen[-1] == "None", seen
    assert seen.index("alice") > seen.index("conv-7")

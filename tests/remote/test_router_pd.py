"""Issue 20, acceptance 2: prefill/decode disaggregation through G4. `vllm-router
--vllm-pd-disaggregation` sends each request to a prefill replica (max_tokens 1,
kv_transfer_params.do_remote_decode) and then to a decode replica with the kv_transfer_params the
prefill answered; nothing but the router and one Redis connects the two replicas. Oracle: a
single engine's greedy answers; the decode replica's cached tokens and G4 hits."""
from __future__ import annotations

import os
import re
import time

import httpx
import pytest

from redis_procs import SERVER, RedisProc, free_port
from router_procs import ROUTER, start_replica, start_router, stop_all
from test_router_fleet import complete, text

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server not installed")
BLOCK = 16


@pytest.fixture(scope="module")
def pd_fleet(ckpt_dir, tmp_path_factory):
    if not os.path.exists(ROUTER):
        pytest.skip("vllm-router is not installed (pip install -e .[test])")
    model = ckpt_dir("llama")
    redis = RedisProc(tmp_path_factory.mktemp("redis"), free_port()).start()
    procs, router = [], None
    try:
        common = ("--served-model-name", "tiny", "--num-gpu-blocks", "256", "--kv-offload-remote", redis.url,
                  "--kv-offload-remote-trusted")
        prefill = start_replica(model, *common, eager=True)
        procs.append(prefill)
        decode = start_replica(model, *common, "--enable-log-requests", eager=True)  # what it served, per request
        procs.append(decode)
        single = start_replica(model, "--served-model-name", "tiny", "--num-gpu-blocks", "256", eager=True)
        procs.append(single)
        router = start_router([], "round_robin", "tiny", "--vllm-pd-disaggregation", "--prefill", prefill.url,
                              "--decode", decode.url)
        yield prefill, decode, single, router
    finally:
        stop_all(router, *procs, redis)


def test_disaggregated_outputs_equal_a_single_engine_and_the_prompt_comes_from_g4(pd_fleet):
    prefill, decode, single, router = pd_fleet
    for i, n in enumerate((40, 97, 160, 64)):
        prompt = text(n, 300 + i)
        want = complete(single.url, prompt, 16)
        g4_before = decode.kv_stats()["tiers"]["G4"]["hit_tokens"]
        got = complete(router.url, prompt, 16)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        n_prompt = want["usage"]["prompt_tokens"]
        # Every full block of the prompt; a prompt ending on a block boundary recomputes its last token.
        full = min(n_prompt // BLOCK * BLOCK, n_prompt - 1)
        assert decode.kv_stats()["tiers"]["G4"]["hit_tokens"] - g4_before == full, (n_prompt, got["usage"])
        # The decode replica's own account of the request: its cached tokens are the prompt's full
        # blocks, all from G4. (vllm-router 0.1.17 answers the client with cached_tokens 0 all the
        # same: it does not pass this usage through; docs/FLEET.md.)
        assert finished(decode, n_prompt) == (full, f"G4={full}")


def finished(replica, prompt_tokens: int, timeout: float = 10) -> tuple[int, str]:
    """(cached_tokens, by tier) from the replica's last request-log line for a prompt of that length."""
    pat = re.compile(rf"Finished request \S+: prompt_tokens={prompt_tokens} cached_tokens=(\d+) \(([^)]*)\)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = [m for line in replica.lines if (m := pat.search(line))]
        if hits:
            return int(hits[-1].group(1)), hits[-1].group(2)
        time.sleep(0.1)
    raise AssertionError(f"no request-log line for a {prompt_tokens}-token prompt:\n" + "".join(replica.lines[-10:]))


def test_params_from_another_system_are_refused_by_name(pd_fleet):
    _, decode, _, _ = pd_fleet
    nixl = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2],
            "remote_host": "10.0.0.1", "remote_port": 5600}
    r = httpx.post(decode.url + "/v1/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 2,
                                                         "kv_transfer_params": nixl}, timeout=60)
    assert r.status_code == 400 and "kvtier" in r.json()["error"]["message"], r.text


def test_a_replica_without_a_shared_tier_refuses_to_play_a_role(pd_fleet):
    _, _, single, _ = pd_fleet  # no --kv-offload-remote
    r = httpx.post(single.url + "/v1/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 1,
                                                         "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
    assert r.status_code == 400 and "--kv-offload-remote" in r.json()["error"]["message"], r.text

"""Issue 20, acceptance 1: two `kvtier serve` replicas sharing one real Redis as G4, behind
`vllm-router` (PyPI) with its `kv_aware` policy fed by kvtier's KV events. Oracles: a single
replica's greedy answers; each replica's own request counters and /v1/kv/stats."""
from __future__ import annotations

import json
import random
import signal
import threading
import time

import httpx
import pytest

from redis_procs import SERVER, RedisProc, free_port
from router_procs import ROUTER, start_replica, start_router, stop_all

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server not installed")
WORDS = "the cat sat on a mat and then ran far away from home into an old dark wood".split()
SPECULATIVE_TTL_S = 2.5  # the router's own guesses (kv_aware's speculative entries) live 2 s


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def complete(url: str, prompt: str, max_tokens: int = 8, timeout: float = 120) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def fleet(ckpt_dir, tmp_path_factory):
    if not (ROUTER and __import__("os").path.exists(ROUTER)):
        pytest.skip("vllm-router is not installed (pip install -e .[test])")
    model = ckpt_dir("llama")
    redis = RedisProc(tmp_path_factory.mktemp("redis"), free_port()).start()
    replicas, router = [], None
    try:
        for _ in range(2):
            replicas.append(start_replica(model, "--served-model-name", "tiny", "--num-gpu-blocks", "256",
                                          "--kv-offloading-size", "0.02", "--kv-offload-remote", redis.url, "--kv-offload-remote-trusted",
                                          eager=True))
        router = start_router(replicas, "kv_aware", "tiny")
        yield model, redis, replicas, router
    finally:
        stop_all(router, *replicas, redis)


def served_by(replicas, before: list[int]) -> list[int]:
    return [i for i, r in enumerate(replicas) if r.finished_requests() > before[i]]


def test_a_repeated_prefix_goes_to_the_replica_that_holds_it(fleet):
    _, _, replicas, router = fleet
    for seed in (1, 2, 3, 4):
        # The prefix is computed on a replica of our choosing, behind the router's back, alternating:
        # with both replicas idle the router's fallback (least load) picks the same one every time,
        # so only the KV events can send half of these to the right place.
        home = seed % 2
        prefix = text(120, seed)  # ~120 tokens: 7 full 16-token blocks
        complete(replicas[home].url, prefix)
        time.sleep(SPECULATIVE_TTL_S)  # events are published once per engine step; let them land
        for turn in range(3):
            before = [r.finished_requests() for r in replicas]
            complete(router.url, prefix + " " + text(10, 100 * seed + turn))
            assert served_by(replicas, before) == [home], (seed, turn, router.log()[-3000:])


def test_answers_through_the_router_equal_a_single_replicas(fleet):
    _, _, replicas, router = fleet
    prompts = [text(40 + 30 * i, 50 + i) for i in range(6)]
    direct = [complete(replicas[0].url, p, 12)["choices"][0]["text"] for p in prompts]
    routed = [complete(router.url, p, 12)["choices"][0]["text"] for p in prompts]
    assert routed == direct


def test_the_other_replica_serves_a_prefix_from_g4(fleet):
    _, _, replicas, _ = fleet
    prompt = text(200, 77)
    first = complete(replicas[0].url, prompt)
    deadline = time.monotonic() + 10  # G4 writes are asynchronous
    while time.monotonic() < deadline and replicas[0].kv_stats()["tiers"].get("G4", {}).get("written_blocks", 0) == 0:
        time.sleep(0.2)
    g4_before = replicas[1].kv_stats()["tiers"]["G4"]["hit_tokens"]
    second = complete(replicas[1].url, prompt)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert replicas[1].kv_stats()["tiers"]["G4"]["hit_tokens"] - g4_before >= 192  # 12 full blocks of 16


def test_streaming_through_the_router_equals_a_single_replica(fleet):
    _, _, replicas, router = fleet
    prompt = text(50, 4242)
    want = complete(replicas[1].url, prompt, 12)["choices"][0]["text"]
    pieces = []
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == want


def test_killing_a_replica_mid_run_loses_no_request(fleet):
    _, _, replicas, router = fleet
    prompts = [text(30 + 7 * i, 900 + i) for i in range(10)]
    want = [complete(replicas[1].url, p, 48)["choices"][0]["text"] for p in prompts]
    got: dict[int, str] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            got[i] = complete(router.url, prompts[i], 48, timeout=300)["choices"][0]["text"]
        except (AssertionError, httpx.HTTPError) as e:
            errors.append(f"{i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(0.3)
    replicas[0].stop(signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert not errors, (errors, router.log()[-3000:])
    assert [got[i] for i in range(len(prompts))] == want

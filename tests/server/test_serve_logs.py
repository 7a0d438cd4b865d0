"""Issue 19, acceptance 4: `kvtier serve`'s periodic stats line and per-request log appear in its
log, and --log-format json makes them JSON objects with their numbers as fields.

Oracles: the responses themselves (usage: prompt, cached and completion tokens; the finish
reason), the server's own /v1/kv/stats (which tier served a repeated prompt), and the prompt's
token ids (which must never reach the log without --log-prompts)."""
from __future__ import annotations

import json
import time

import pytest

from checkpoints import random_prompt
from serving import start_server

G1_BLOCKS = 64  # 1,024 tokens: a 900-token prompt pushes a 600-token one out of G1
LONG, FLOOD = random_prompt(600, 5301), random_prompt(900, 5302)


@pytest.fixture(scope="module")
def srv(ckpt_dir):
    s = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--kv-offloading-size", "0.05",
                     "--enable-log-requests", "--log-format", "json", "--log-stats-interval", "1")
    yield s
    assert s.stop() == 0


def records(srv) -> list[dict]:
    out = []
    for line in srv.lines:
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def complete(srv, prompt: list[int], rid: str) -> dict:
    with srv.client() as c:
        r = c.post("/v1/completions", json={"model": srv.model, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                            "ignore_eos": True, "request_id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(srv, pred, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in records(srv) if pred(r)]
        if found:
            return found[-1]
        time.sleep(0.2)
    raise AssertionError(f"no such log record within {timeout}s; log tail:\n{srv.log()[-3000:]}")


def test_per_request_lines_match_the_responses_and_never_hold_the_prompt(srv):
    first = complete(srv, LONG, "log-a")
    complete(srv, FLOOD, "log-b")  # evicts LONG's blocks from G1; they stay in G2
    again = complete(srv, LONG, "log-c")
    with srv.client() as c:
        g2_hits = c.get("/v1/kv/stats").json()["tiers"]["G2"]["hit_tokens"]
    assert g2_hits > 0
    for rid, resp in (("log-a", first), ("log-c", again)):
        rec = wait_for(srv, lambda r, rid=rid: r.get("request_id") == rid and "finish_reason" in r)
        usage = resp["usage"]
        assert rec["logger"] == "kvtier.requests" and rec["process"] == "api" and rec["level"] == "info"
        assert rec["prompt_tokens"] == usage["prompt_tokens"] == len(LONG)
        assert rec["output_tokens"] == usage["completion_tokens"] == 3
        assert rec["finish_reason"] == resp["choices"][0]["finish_reason"] == "length"
        assert rec["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert sum(rec["cached_tokens_by_tier"].values()) == rec["cached_tokens"]
        assert 0 < rec["ttft_s"] <= rec["latency_s"]
        assert f"Finished request {rid}: prompt_tokens={len(LONG)}" in rec["message"]
    assert wait_for(srv, lambda r: r.get("request_id") == "log-c")["cached_tokens_by_tier"].get("G2", 0) > 0
    text = srv.log()
    assert ", ".join(map(str, LONG[:20])) not in text, "a prompt reached the log without --log-prompts"
    assert not any(r["message"].startswith("Received request") for r in records(srv))


def test_periodic_stats_line_while_busy(srv):
    complete(srv, random_prompt(200, 5303), "log-d")
    rec = wait_for(srv, lambda r: r["logger"] == "kvtier.stats" and r["prompt_throughput"] > 0, timeout=15)
    assert rec["message"].startswith("Avg prompt throughput:")
    assert set(rec["tiers"]) == {"G2"} and {"hit_tokens", "bytes_in", "bytes_out"} <= set(rec["tiers"]["G2"])
    assert 0 <= rec["g1_usage"] <= 1 and rec["running"] >= 0 and rec["waiting"] >= 0
    # Idle: no line for a while (the interval is 1 s).
    time.sleep(1.5)
    n = sum(r["logger"] == "kvtier.stats" for r in records(srv))
    time.sleep(2.5)
    assert sum(r["logger"] == "kvtier.stats" for r in records(srv)) == n, "stats lines while idle"


def test_every_log_line_of_both_processes_is_json(srv):
    lines = [x.strip() for x in srv.lines if x.strip()]
    not_json = [x for x in lines if not x.startswith("{") and not x.startswith("kvtier: serving ")]
    assert not not_json, not_json[:5]
    procs = {r["process"] for r in records(srv)}
    assert procs == {"api", "core"}, procs
    for r in records(srv):
        assert {"time", "level", "process", "logger", "message"} <= set(r)


def _snap(prompt: int, gen: int, queries: int, hits: int, g2: tuple[int, int, int], running: int = 0) -> dict:
    return {"prompt_tokens": prompt, "generation_tokens": gen, "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "num_preemptions": 0, "num_running": running, "num_waiting": 0,
            "kv_cache_usage": 0.25, "tiers": {"G2": {"hit_tokens": g2[0], "bytes_written": g2[1], "bytes_read": g2[2]},
                                             "write_policy": "write_through"}}


def test_stats_line_is_the_interval_deltas(caplog):
    import logging

    from server.stats_log import StatsLogger

    sl = StatsLogger(2.0)
    with caplog.at_level(logging.INFO, logger="kvtier.stats"):
        assert not sl.report(_snap(100, 10, 80, 20, (0, 1000, 0)), 10.0)  # the baseline
        assert sl.report(_snap(500, 30, 480, 220, (64, 9000, 4000), running=1), 12.0)
        assert not sl.report(_snap(500, 30, 480, 220, (64, 9000, 4000)), 14.0)  # idle: nothing moved
    (rec,) = caplog.records
    f = rec.kvtier_fields
    assert f["prompt_throughput"] == 200 and f["generation_throughput"] == 10 and f["prefix_cache_hit_rate"] == 0.5
    assert f["tiers"] == {"G2": {"hit_tokens": 64, "bytes_in": 8000, "bytes_out": 4000}}
    assert "Prefix cache hit rate: 50.0%" in rec.getMessage() and "G2: 64 hit tokens" in rec.getMessage()
    with pytest.raises(ValueError, match="--log-stats-interval"):
        StatsLogger(0)

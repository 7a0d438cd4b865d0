"""`--metrics-compat` in process: server/metrics_compat.py's table says exactly what /metrics
writes, compat off writes no vLLM name, and vLLM's observation rules hold (a one-token request's
time per output token is 0 in vLLM's series, absent in kvtier's). The live-server checks are in
test_grafana_metrics.py."""
from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics
from server.metrics_compat import (DEFAULT_METRICS_COMPAT, METRICS_COMPAT_CHOICES, VLLM_METRICS, NotExported,
                                   buckets_1_2_5, exported_names, make_compat)

SNAPSHOT = {
    "num_running": 1, "num_waiting": 2, "kv_cache_usage": 0.25, "prefix_cache_queries": 64, "prefix_cache_hits": 16,
    "num_preemptions": 1, "prompt_tokens": 96, "generation_tokens": 9, "num_evictions": 3, "num_gpu_blocks": 64,
    "kv_groups": [], "spec_decode": {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 7,
                                     "accepted_per_pos": [4, 2, 1]},
    "tiers": {"lookup_tokens": 48,
              "G2": {"backend": "host", "hit_tokens": 16, "miss_tokens": 32, "blocks": 3, "capacity_blocks": 10,
                     "corrupt": 0, "bytes_in": 100, "bytes_out": 50, "evictions": 0},
              "G3": {"backend": "disk", "hit_tokens": 0, "miss_tokens": 32, "bytes_written": 5, "bytes_read": 0,
                     "corrupt": 1, "evictions": 0}},
}


def families(text: bytes) -> dict[str, list]:
    """Family name -> samples (counters under their name without `_total`, as the table keys them)."""
    return {f.name: f.samples for f in text_string_to_metric_families(text.decode())}


def served(compat: str) -> Metrics:
    m = Metrics("tiny")
    m.enable_compat(compat, 2048)
    m.observe_request(0.0, 0.1, 0.5, 5, "length", 40, {"G1": 16, "G2": 16}, queue_s=0.02, prefill_s=0.07,
                      token_gaps=(0.1, 0.1, 0.05, 0.15))
    m.observe_request(1.0, 1.2, 1.2, 1, "stop", 8, {})  # never said when it was scheduled: no phase values
    m.observe_group(5)
    m.observe_abort()
    return m


def test_compat_off_writes_no_vllm_name():
    assert DEFAULT_METRICS_COMPAT == "none" and set(METRICS_COMPAT_CHOICES) == {"none", "vllm"}
    text = served(DEFAULT_METRICS_COMPAT).render(SNAPSHOT)
    assert b"vllm:" not in text and b"kvtier:e2e_request_latency_seconds_count" in text


def test_the_table_is_what_compat_writes():
    fams = families(served("vllm").render(SNAPSHOT))
    written = {name for name in fams if name.startswith("vllm:")}
    assert written == set(exported_names())
    assert not written & {name for name, row in VLLM_METRICS.items() if isinstance(row, NotExported)}
    assert all(re.fullmatch(r"vllm:[a-z0-9_]+", name) for name in VLLM_METRICS)


def test_engine_down_keeps_request_series_only():
    fams = families(served("vllm").render(None))
    assert "vllm:e2e_request_latency_seconds" in fams and "vllm:num_requests_running" not in fams


def test_vllm_observation_rules():
    fams = families(served("vllm").render(SNAPSHOT))

    def one(name: str, suffix: str) -> float:
        return next(s.value for s in fams[name] if s.name == name + suffix)

    # vLLM observes every finished request's mean TPOT (0 with one token); kvtier's own skips it.
    assert one("vllm:request_time_per_output_token_seconds", "_count") == 2
    assert one("vllm:request_time_per_output_token_seconds", "_sum") == pytest.approx(0.1)
    assert one("kvtier:time_per_output_token_seconds", "_count") == 1
    assert one("vllm:request_decode_time_seconds", "_sum") == pytest.approx(0.4)
    les = [float(s.labels["le"]) for s in fams["vllm:request_prompt_tokens"] if s.name.endswith("_bucket")]
    assert les[:-1] == list(buckets_1_2_5(2048)) and les[-1] == float("inf")
    per_pos = {s.labels["position"]: s.value for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"]}
    assert per_pos == {"0": 4, "1": 2, "2": 1}
    # Per-step gaps (one observation each), the core's phases, and one value per request.
    assert one("vllm:time_per_output_token_seconds", "_count") == one("vllm:inter_token_latency_seconds", "_count") == 4
    assert one("vllm:inter_token_latency_seconds", "_sum") == pytest.approx(0.4)
    assert one("vllm:request_queue_time_seconds", "_count") == 1
    assert one("vllm:request_queue_time_seconds", "_sum") == pytest.approx(0.02)
    assert one("vllm:request_prefill_time_seconds", "_sum") == pytest.approx(0.07)
    assert one("vllm:request_inference_time_seconds", "_sum") == pytest.approx(0.07 + 0.4)
    assert one("vllm:request_max_num_generation_tokens", "_count") == 1
    assert one("vllm:request_max_num_generation_tokens", "_sum") == 5
    reasons = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"]}
    assert reasons == {"stop": 1, "length": 1, "abort": 1, "error": 0}
    assert one("vllm:e2e_request_latency_seconds", "_count") == 2  # the abort has no latencies


def test_tier_occupancy_only_where_a_tier_counts_blocks():
    fams = families(Metrics("tiny").render(SNAPSHOT))
    assert [(s.labels["tier"], s.value) for s in fams["kvtier:offload_blocks"]] == [("G2", 3)]
    assert [(s.labels["tier"], s.value) for s in fams["kvtier:offload_capacity_blocks"]] == [("G2", 10)]
    assert fams["kvtier:kv_cache_capacity_blocks"][0].value == 64


def test_helpers_and_flag():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)  # vLLM's docstring example
    with pytest.raises(ValueError, match="none, vllm"):
        make_compat("prometheus", None, "m", 16, lambda: None)  # type: ignore[arg-type]
    m = Metrics("tiny")
    m.enable_compat("none", 16)
    assert m.compat is None
    from server.serve import build_parser

    p = build_parser()
    assert p.parse_args([]).metrics_compat == DEFAULT_METRICS_COMPAT
    assert p.parse_args(["--metrics-compat", "vllm"]).metrics_compat == "vllm"
    assert "--metrics-compat" in p.format_help()

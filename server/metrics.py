"""`/metrics`: vLLM's metric names under a `kvtier:` prefix, plus the offload tiers.

Request latencies are observed in the API process, which sees every token arrive. Engine
gauges and counters come from a stats snapshot the core sends when /metrics is scraped, so
they are exact at scrape time without the core pushing anything per step."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from connectors.base import tier_entries

P = "kvtier:"
disable_created_metrics()  # no `_created` series beside every counter (vLLM turns them off too)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TIER_SOURCES = {"G1": "local_cache_hit"}  # other tiers count as external_kv_transfer, as in vLLM


class _EngineCollector(Collector):
    def __init__(self, model: str) -> None:
        self.model = model
        self.snapshot: dict[str, Any] | None = None

    def collect(self) -> Iterator[Any]:
        s = self.snapshot
        if s is None:
            return
        lab, m = ["model_name"], [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=lab)
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=lab)
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of G1 KV blocks in use (0-1).", s["kv_cache_usage"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the G1 prefix cache.", s["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the G1 prefix cache.", s["prefix_cache_hits"])
        yield counter("num_preemptions", "Requests preempted to free G1 blocks.", s["num_preemptions"])
        yield counter("prompt_tokens", "Prompt tokens received by the engine.", s["prompt_tokens"])
        yield counter("generation_tokens", "Tokens generated.", s["generation_tokens"])
        yield counter("kv_cache_evictions", "Cached G1 blocks evicted.", s["num_evictions"])
        groups = GaugeMetricFamily(P + "kv_group_held_blocks", "G1 blocks requests hold, per KV group.",
                                   labels=lab + ["group", "window"])
        for i, g in enumerate(s.get("kv_groups") or ()):
            groups.add_metric(m + [str(i), str(g["window"])], g["held_blocks"])
        yield groups
        sd = s.get("spec_decode")
        if sd is not None:  # vLLM's spec_decode_* series
            yield counter("spec_decode_num_drafts", "Verified proposals (one per request per step).", sd["num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Proposed tokens.", sd["num_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", sd["num_accepted_tokens"])
            per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                          "Proposed tokens accepted, by position in the proposal.", labels=lab + ["position"])
            for pos, n in enumerate(sd["accepted_per_pos"]):
                per_pos.add_metric(m + [str(pos)], n)
            yield per_pos
        tiers = s.get("tiers") or {}
        hits = CounterMetricFamily(P + "offload_hit_tokens", "Prompt tokens served by an offload tier.",
                                   labels=lab + ["tier"])
        miss = CounterMetricFamily(P + "offload_miss_tokens", "Prompt tokens looked up in an offload tier and not found.",
                                   labels=lab + ["tier"])
        moved = CounterMetricFamily(P + "offload_bytes", "Bytes written into (in) or read out of (out) an offload tier.",
                                    labels=lab + ["tier", "direction"])
        bad = CounterMetricFamily(P + "offload_corrupt_entries", "Tier entries found corrupt and dropped.",
                                  labels=lab + ["tier"])
        evict = CounterMetricFamily(P + "offload_evictions", "Blocks evicted from an offload tier.", labels=lab + ["tier"])
        info = GaugeMetricFamily(P + "offload_tier_info", "The storage backend of each offload tier (value 1).",
                                 labels=lab + ["tier", "backend"])
        for tier, t in tier_entries(tiers).items():
            info.add_metric(m + [tier, str(t.get("backend", "unknown"))], 1)
            hits.add_metric(m + [tier], t.get("hit_tokens", 0))
            miss.add_metric(m + [tier], t.get("miss_tokens", 0))
            moved.add_metric(m + [tier, "in"], t.get("bytes_in", t.get("bytes_written", 0)))
            moved.add_metric(m + [tier, "out"], t.get("bytes_out", t.get("bytes_read", 0)))
            bad.add_metric(m + [tier], t.get("corrupt", 0))
            evict.add_metric(m + [tier], t.get("evictions", 0))
        yield from (info, hits, miss, moved, bad, evict)


class Metrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Time per output token after the first.", lab,
                              buckets=TPOT_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self.success = Counter(P + "request_success", "Finished requests, by finish reason.", lab + ["finished_reason"],
                               registry=r)
        self.by_source = Counter(P + "prompt_tokens_by_source", "Prompt tokens by where their KV came from: "
                                 "computed (local_compute), the G1 prefix cache (local_cache_hit) or an offload "
                                 "tier (external_kv_transfer).", lab + ["source"], registry=r)
        self.by_tier = Counter(P + "prompt_tokens_cached_by_tier", "Prompt tokens not computed, by the tier that "
                               "supplied them (G1, G2, G3).", lab + ["tier"], registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused before reaching the engine, by HTTP status.",
                                lab + ["status"], registry=r)
        self.engine = _EngineCollector(model)
        r.register(self.engine)

    def observe_request(self, arrival: float, first_token: float | None, finished: float, num_output: int,
                        finish_reason: str, num_prompt: int, cached_by_tier: dict[str, int]) -> None:
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output > 1:
                self.tpot.observe((finished - first_token) / (num_output - 1))
        self.e2e.observe(finished - arrival)
        self.success.labels(self.model, finish_reason).inc()
        cached = 0
        for tier, n in cached_by_tier.items():
            self.by_source.labels(self.model, TIER_SOURCES.get(tier, "external_kv_transfer")).inc(n)
            self.by_tier.labels(self.model, tier).inc(n)
            cached += n
        self.by_source.labels(self.model, "local_compute").inc(max(num_prompt - cached, 0))

    def render(self, snapshot: dict[str, Any] | None) -> bytes:
        self.engine.snapshot = snapshot
        return generate_latest(self.registry)

"""`/metrics`: vLLM's metric names under a `kvtier:` prefix, plus the offload tiers.

Request latencies are observed in the API process, which sees every token arrive. Engine
gauges and counters come from a stats snapshot the core sends when /metrics is scraped, so
they are exact at scrape time without the core pushing anything per step. With
`--metrics-compat vllm` the same inputs also feed vLLM-named copies (server/metrics_compat.py)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from connectors.base import tier_entries
from server.metrics_compat import VllmCompat, make_compat

P = "kvtier:"
disable_created_metrics()  # no `_created` series beside every counter (vLLM turns them off too)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TIER_SOURCES = {"G1": "local_cache_hit"}  # other tiers count as external_kv_transfer, as in vLLM


@dataclass(frozen=True)
class FinishedSequence:
    """One finished sequence as the API process saw it (monotonic seconds): the input of every
    per-request series, kvtier's and the compat ones alike."""
    arrival: float
    first_token: float | None  # None: it ended before its first token
    finished: float
    num_output: int
    finish_reason: str
    num_prompt: int
    cached_by_tier: dict[str, int]
    queue_s: float | None = None  # the core's: arrival to first scheduled (None: never scheduled)
    prefill_s: float | None = None  # the core's: first scheduled to first token
    token_gaps: tuple[float, ...] = ()  # the API's: seconds between successive steps' tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def decode_seconds(self) -> float:
        """First token to the end (0 without a first token: no decode phase)."""
        return 0.0 if self.first_token is None else self.finished - self.first_token

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token is None or self.num_output < 2:
            return None
        return self.decode_seconds / (self.num_output - 1)

    def by_source(self) -> dict[str, int]:
        """Prompt tokens by where their KV came from, under vLLM's source label values."""
        out = {"local_compute": max(self.num_prompt - sum(self.cached_by_tier.values()), 0)}
        for tier, n in self.cached_by_tier.items():
            src = TIER_SOURCES.get(tier, "external_kv_transfer")
            out[src] = out.get(src, 0) + n
        return out


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
        yield gauge("kv_cache_capacity_blocks", "G1 KV blocks in all.", s["num_gpu_blocks"])
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
        enc = s.get("encoder_cache")
        if enc is not None:  # a model that takes images
            yield counter("mm_encoder_cache_hits", "Images whose encoder output was reused.", enc["hits"])
            yield counter("mm_encoder_cache_misses", "Images encoded.", enc["misses"])
            yield gauge("mm_encoder_cache_bytes", "Host memory the kept encoder outputs take.", enc["bytes"])
        lo = s.get("lora")
        if lo is not None:  # enable_lora; vLLM's lora_requests_info, and requests per adapter
            info = GaugeMetricFamily(P + "lora_requests_info", "LoRA adapters of running and waiting requests "
                                     "(value 1).", labels=lab + ["max_lora", "running_lora_adapters",
                                                                  "waiting_lora_adapters"])
            info.add_metric(m + [str(lo["max_lora"]), ",".join(lo["running"]), ",".join(lo["waiting"])], 1)
            yield info
            per = CounterMetricFamily(P + "lora_requests", "Requests admitted under each LoRA adapter.",
                                      labels=lab + ["lora_name"])
            for name, n in sorted(lo["requests"].items()):
                per.add_metric(m + [name], n)
            yield per
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
        # Occupancy only where a tier reports it: G2 counts blocks, storage backends that can tell
        # cheaply report bytes (a shared Redis cannot). The others get no series, not a made-up 0.
        held = GaugeMetricFamily(P + "offload_blocks", "Blocks an offload tier holds (tiers that count them).",
                                 labels=lab + ["tier"])
        cap = GaugeMetricFamily(P + "offload_capacity_blocks", "Blocks an offload tier can hold (tiers that count "
                                "them).", labels=lab + ["tier"])
        used = GaugeMetricFamily(P + "offload_used_bytes", "Bytes an offload tier stores (tiers that report it).",
                                 labels=lab + ["tier"])
        size = GaugeMetricFamily(P + "offload_capacity_bytes", "Bytes an offload tier may store (bounded tiers that "
                                 "report it).", labels=lab + ["tier"])
        queued = GaugeMetricFamily(P + "offload_queued_write_bytes", "Bytes waiting to be written to an offload tier "
                                   "(its write backlog).", labels=lab + ["tier"])
        dropped = CounterMetricFamily(P + "offload_dropped_writes", "Writes an offload tier's full queue refused.",
                                      labels=lab + ["tier"])
        for tier, t in tier_entries(tiers).items():
            if "queued_write_bytes" in t:
                queued.add_metric(m + [tier], t["queued_write_bytes"])
                dropped.add_metric(m + [tier], t.get("dropped_writes", 0))
            info.add_metric(m + [tier, str(t.get("backend", "unknown"))], 1)
            hits.add_metric(m + [tier], t.get("hit_tokens", 0))
            miss.add_metric(m + [tier], t.get("miss_tokens", 0))
            moved.add_metric(m + [tier, "in"], t.get("bytes_in", t.get("bytes_written", 0)))
            moved.add_metric(m + [tier, "out"], t.get("bytes_out", t.get("bytes_read", 0)))
            bad.add_metric(m + [tier], t.get("corrupt", 0))
            evict.add_metric(m + [tier], t.get("evictions", 0))
            if "blocks" in t and "capacity_blocks" in t:
                held.add_metric(m + [tier], t["blocks"])
                cap.add_metric(m + [tier], t["capacity_blocks"])
            if t.get("used_bytes") is not None:
                used.add_metric(m + [tier], t["used_bytes"])
            if t.get("capacity_bytes") is not None:  # None: unbounded
                size.add_metric(m + [tier], t["capacity_bytes"])
        yield from (info, hits, miss, moved, bad, evict, held, cap, used, size, queued, dropped)


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
        self.compat: VllmCompat | None = None

    def enable_compat(self, mode: str, max_model_len: int) -> None:
        """Also write `mode`'s series names (server.metrics_compat; "none" adds nothing). Call it
        once, before the first request: sequences observed earlier are not replayed."""
        if self.compat is not None:
            raise RuntimeError("metrics compat is already enabled")
        self.compat = make_compat(mode, self.registry, self.model, max_model_len, lambda: self.engine.snapshot)

    def observe_request(self, arrival: float, first_token: float | None, finished: float, num_output: int,
                        finish_reason: str, num_prompt: int, cached_by_tier: dict[str, int], *,
                        queue_s: float | None = None, prefill_s: float | None = None,
                        token_gaps: tuple[float, ...] = ()) -> None:
        seq = FinishedSequence(arrival, first_token, finished, num_output, finish_reason, num_prompt, cached_by_tier,
                               queue_s, prefill_s, token_gaps)
        if seq.ttft is not None:
            self.ttft.observe(seq.ttft)
        if seq.tpot is not None:
            self.tpot.observe(seq.tpot)
        self.e2e.observe(finished - arrival)
        self.success.labels(self.model, finish_reason).inc()
        for source, n in seq.by_source().items():
            self.by_source.labels(self.model, source).inc(n)
        for tier, n in cached_by_tier.items():
            self.by_tier.labels(self.model, tier).inc(n)
        if self.compat is not None:
            self.compat.observe(seq)

    def observe_abort(self) -> None:
        """A sequence its client gave up on: counted by finish reason only (its latencies would say
        how long the client waited, not how the server did)."""
        self.success.labels(self.model, "abort").inc()
        if self.compat is not None:
            self.compat.observe_abort()

    def observe_group(self, max_output: int) -> None:
        """A request all of whose n sequences finished: the longest one's output tokens."""
        if self.compat is not None:
            self.compat.observe_group(max_output)

    def render(self, snapshot: dict[str, Any] | None) -> bytes:
        self.engine.snapshot = snapshot
        return generate_latest(self.registry)

"""`kvtier serve --metrics-compat vllm`: vLLM's own series names beside kvtier's.

vLLM's dashboards and alerts query `vllm:*`. With compat on, /metrics also carries a `vllm:`
series for each entry of VLLM_METRICS that kvtier can fill with the same meaning: the same
quantity and unit, vLLM's labels (`model_name`, and `engine="0"`: kvtier runs one engine core),
counters as counters, histograms with vLLM's own bucket boundaries (an alert on one `le` keeps
working). They are computed from the inputs kvtier's own series use (a finished sequence in the
API process, the engine's stats snapshot at scrape time), never copied from kvtier's series, whose
buckets differ. With compat off nothing here is registered: no `vllm:` series at all.

VLLM_METRICS is the whole mapping in one place: every vLLM name considered, what writes it, or
why nothing does. Keys are vLLM's family names: a counter's samples end in `_total`, a histogram's
in `_bucket`, `_sum` and `_count`. Sources: vLLM's vllm/v1/metrics/loggers.py and the dashboard
its docs publish, examples/online_serving/prometheus_grafana/grafana.json."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from server.metrics import FinishedSequence

METRICS_COMPAT_CHOICES = ("none", "vllm")
DEFAULT_METRICS_COMPAT = "none"
ENGINE = "0"  # vLLM labels every series with its engine core's index; kvtier has one core
# The request-side counters' label values, all present from the start as in vLLM.
REQUEST_LABEL_VALUES = {"request:finish_reason": ("stop", "length", "abort", "error"),
                        "request:by_source": ("local_compute", "local_cache_hit", "external_kv_transfer")}

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class Exported:
    """A vLLM series kvtier writes under `--metrics-compat vllm`."""
    kind: Literal["gauge", "counter", "histogram"]
    # Where the value comes from: a key path into the engine's stats snapshot ("spec_decode.num_drafts"),
    # or "request:X", each finished sequence's value (histograms: REQUEST_VALUES) or label (counters:
    # REQUEST_LABEL_VALUES).
    source: str
    twin: str  # the kvtier series with the same meaning, for a reader comparing the two
    doc: str  # vLLM's help text
    buckets: tuple[float, ...] | None = None  # histograms: vLLM's bounds; None: 1-2-5 up to max_model_len
    label: str | None = None  # a counter's own label beside model_name and engine


@dataclass(frozen=True)
class NotExported:
    """A vLLM series kvtier does not write, and why."""
    why: str


VLLM_METRICS: dict[str, Exported | NotExported] = {
    # -- engine state and counters: the core's stats snapshot, read at scrape time --------------
    "vllm:num_requests_running": Exported("gauge", "num_running", "kvtier:num_requests_running",
                                          "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": Exported("gauge", "num_waiting", "kvtier:num_requests_waiting",
                                          "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": Exported("gauge", "kv_cache_usage", "kvtier:kv_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage."),
    # vLLM's name before 0.9, which its published dashboard still queries.
    "vllm:gpu_cache_usage_perc": Exported("gauge", "kv_cache_usage", "kvtier:kv_cache_usage_perc",
                                          "GPU KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": Exported("counter", "prefix_cache_queries", "kvtier:prefix_cache_queries",
                                          "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": Exported("counter", "prefix_cache_hits", "kvtier:prefix_cache_hits",
                                       "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:num_preemptions": Exported("counter", "num_preemptions", "kvtier:num_preemptions",
                                     "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": Exported("counter", "prompt_tokens", "kvtier:prompt_tokens",
                                   "Number of prefill tokens processed."),
    "vllm:generation_tokens": Exported("counter", "generation_tokens", "kvtier:generation_tokens",
                                       "Number of generation tokens processed."),
    "vllm:spec_decode_num_drafts": Exported("counter", "spec_decode.num_drafts", "kvtier:spec_decode_num_drafts",
                                            "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": Exported("counter", "spec_decode.num_draft_tokens",
                                                  "kvtier:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens": Exported("counter", "spec_decode.num_accepted_tokens",
                                                     "kvtier:spec_decode_num_accepted_tokens",
                                                     "Number of accepted tokens."),
    "vllm:spec_decode_num_accepted_tokens_per_pos": Exported(
        "counter", "spec_decode.accepted_per_pos", "kvtier:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.", label="position"),
    # -- per finished sequence, observed in the API process -------------------------------------
    "vllm:request_success": Exported("counter", "request:finish_reason", "kvtier:request_success",
                                     "Count of successfully processed requests.", label="finished_reason"),
    "vllm:prompt_tokens_by_source": Exported("counter", "request:by_source", "kvtier:prompt_tokens_by_source",
                                             "Number of prompt tokens by source.", label="source"),
    "vllm:time_to_first_token_seconds": Exported("histogram", "request:ttft", "kvtier:time_to_first_token_seconds",
                                                 "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:e2e_request_latency_seconds": Exported("histogram", "request:e2e", "kvtier:e2e_request_latency_seconds",
                                                 "Histogram of e2e request latency in seconds.",
                                                 REQUEST_LATENCY_BUCKETS),
    # vLLM observes every finished request, 0 for one with fewer than two tokens (kvtier's twin skips those).
    "vllm:request_time_per_output_token_seconds": Exported(
        "histogram", "request:tpot", "kvtier:time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS),
    "vllm:request_decode_time_seconds": Exported(
        "histogram", "request:decode", "kvtier:time_per_output_token_seconds (its numerator: first token to end)",
        "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
    "vllm:request_prompt_tokens": Exported("histogram", "request:num_prompt", "kvtier:prompt_tokens (per request)",
                                           "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": Exported("histogram", "request:num_output",
                                               "kvtier:generation_tokens (per request)",
                                               "Number of generation tokens processed."),
    # One observation per engine step after a sequence's first token: the gap between the deltas
    # the API process receives (a step's tokens, speculative ones included, arrive in one delta).
    "vllm:time_per_output_token_seconds": Exported(
        "histogram", "request:token_gaps", "kvtier:time_per_output_token_seconds (its per-sequence mean)",
        "Histogram of time per output token in seconds.", TPOT_BUCKETS),
    "vllm:inter_token_latency_seconds": Exported(
        "histogram", "request:token_gaps", "kvtier:time_per_output_token_seconds (its per-sequence mean)",
        "Histogram of inter-token latency in seconds.", TPOT_BUCKETS),
    # The core's own clock: arrival to first scheduled (a load from a lower tier counts as queue
    # time), first scheduled to first token, first scheduled to the end.
    "vllm:request_queue_time_seconds": Exported("histogram", "request:queue", "none",
                                                "Histogram of time spent in WAITING phase for request.",
                                                REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": Exported("histogram", "request:prefill", "none",
                                                  "Histogram of time spent in PREFILL phase for request.",
                                                  REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": Exported("histogram", "request:inference", "none",
                                                    "Histogram of time spent in RUNNING phase for request.",
                                                    REQUEST_LATENCY_BUCKETS),
    # Per request (all of its n sequences finished), not per sequence.
    "vllm:request_max_num_generation_tokens": Exported(
        "histogram", "group:max_output", "none", "Histogram of maximum number of requested generation tokens."),
    # -- not exported -----------------------------------------------------------------------------
    "vllm:time_per_prefill_token_request_seconds": NotExported(
        "newer than vLLM's published dashboard and its bucket boundaries not pinned down here; "
        "vllm:request_prefill_time_seconds and vllm:request_prompt_tokens give the same ratio"),
    "vllm:request_params_n": NotExported("a request parameter: kvtier's metrics see finished sequences, not requests"),
    "vllm:request_params_max_tokens": NotExported("a request parameter, as vllm:request_params_n"),
    "vllm:iteration_tokens_total": NotExported("tokens per engine step: the core reports running totals at scrape "
                                               "time, not one value per step"),
    "vllm:num_requests_swapped": NotExported("vLLM V0's swap space (older revisions of its dashboard query it): "
                                             "kvtier never swaps a request out; a preempted one recomputes"),
    "vllm:cpu_cache_usage_perc": NotExported("vLLM V0's swap space, as vllm:num_requests_swapped; G2 is a prefix "
                                             "cache, not swap space (see kvtier:offload_blocks)"),
    "vllm:gpu_prefix_cache_queries": NotExported("vLLM's pre-0.9 name, hidden since 0.10: vllm:prefix_cache_queries "
                                                 "is exported"),
    "vllm:gpu_prefix_cache_hits": NotExported("vLLM's pre-0.9 name, as vllm:gpu_prefix_cache_queries"),
    "vllm:external_prefix_cache_queries": NotExported(
        "one total over the KV connector's lookups; kvtier counts them per tier (kvtier:offload_hit_tokens, "
        "kvtier:offload_miss_tokens) and no single total is computed"),
    "vllm:external_prefix_cache_hits": NotExported("as vllm:external_prefix_cache_queries"),
    "vllm:cache_config_info": NotExported("an info gauge labelled with vLLM's CacheConfig fields, which kvtier's "
                                          "config does not share (G1's size: kvtier:kv_cache_capacity_blocks)"),
}

# The per-sequence values "request:X" sources name (None: nothing to observe, as in vLLM).
REQUEST_VALUES: dict[str, Callable[[FinishedSequence], float | None]] = {
    "request:ttft": lambda s: s.ttft,
    "request:e2e": lambda s: s.finished - s.arrival,
    "request:decode": lambda s: s.decode_seconds,
    "request:tpot": lambda s: s.tpot if s.tpot is not None else 0.0,
    "request:num_prompt": lambda s: s.num_prompt,
    "request:num_output": lambda s: s.num_output,
    "request:queue": lambda s: s.queue_s,
    "request:prefill": lambda s: s.prefill_s,
    "request:inference": lambda s: None if s.prefill_s is None else s.prefill_s + s.decode_seconds,
}
# Sources with several observations per sequence.
REQUEST_SERIES: dict[str, Callable[[FinishedSequence], Iterable[float]]] = {
    "request:token_gaps": lambda s: s.token_gaps,
}
GROUP_SOURCE = "group:max_output"  # observed once per request, by `observe_group`


def exported_names() -> list[str]:
    """The vLLM family names compat writes (a snapshot series only while the snapshot has it)."""
    return [name for name, row in VLLM_METRICS.items() if isinstance(row, Exported)]


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def _lookup(snapshot: dict[str, Any], path: str) -> Any:
    """The value at a dotted key path, None where any step is missing or None."""
    value: Any = snapshot
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


class VllmCompat(Collector):
    """The vLLM-named series on kvtier's registry (one /metrics). Request-side ones are observed
    per finished sequence (`observe`); engine ones are read from the snapshot when collected."""

    def __init__(self, registry: CollectorRegistry, model: str, max_model_len: int,
                 snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self.model, self.snapshot = model, snapshot
        self.label_values = [model, ENGINE]
        lab = ["model_name", "engine"]
        self._histograms: list[tuple[Callable[[FinishedSequence], float | None], Any]] = []
        self._series: list[tuple[Callable[[FinishedSequence], Iterable[float]], Any]] = []
        self._groups: list[Any] = []
        for name, row in VLLM_METRICS.items():
            if isinstance(row, Exported) and row.kind == "histogram":
                buckets = row.buckets or buckets_1_2_5(max_model_len)
                h = Histogram(name, row.doc, lab, buckets=buckets, registry=registry).labels(*self.label_values)
                if row.source == GROUP_SOURCE:
                    self._groups.append(h)
                elif row.source in REQUEST_SERIES:
                    self._series.append((REQUEST_SERIES[row.source], h))
                else:
                    self._histograms.append((REQUEST_VALUES[row.source], h))
        self._counters: dict[str, Counter] = {}  # by source: "request:finish_reason", "request:by_source"
        for name, row in VLLM_METRICS.items():
            if isinstance(row, Exported) and row.kind == "counter" and row.source in REQUEST_LABEL_VALUES:
                c = Counter(name, row.doc, lab + ([row.label] if row.label else []), registry=registry)
                for v in REQUEST_LABEL_VALUES[row.source]:  # present at 0 from the start, as vLLM's are
                    c.labels(*self.label_values, v)
                self._counters[row.source] = c
        registry.register(self)

    def observe(self, seq: FinishedSequence) -> None:
        for value_of, child in self._histograms:
            value = value_of(seq)
            if value is not None:
                child.observe(value)
        for values_of, child in self._series:
            for value in values_of(seq):
                child.observe(value)
        self._counters["request:finish_reason"].labels(*self.label_values, seq.finish_reason).inc()
        for source, n in seq.by_source().items():
            self._counters["request:by_source"].labels(*self.label_values, source).inc(n)

    def observe_abort(self) -> None:
        self._counters["request:finish_reason"].labels(*self.label_values, "abort").inc()

    def observe_group(self, max_output: int) -> None:
        for child in self._groups:
            child.observe(max_output)

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot()
        if snap is None:  # the engine is down: its series are absent, as kvtier's are
            return
        for name, row in VLLM_METRICS.items():
            if not isinstance(row, Exported) or row.source.startswith(("request:", "group:")):  # observed, not read
                continue
            value = _lookup(snap, row.source)
            if value is not None:  # e.g. spec_decode without speculative decoding
                yield self._family(name, row, value)

    def _family(self, name: str, row: Exported, value: Any) -> GaugeMetricFamily | CounterMetricFamily:
        cls = GaugeMetricFamily if row.kind == "gauge" else CounterMetricFamily
        labels = ["model_name", "engine"] + ([row.label] if row.label else [])
        fam = cls(name, row.doc, labels=labels)
        if row.label:  # a list: one sample per position
            for i, v in enumerate(value):
                fam.add_metric(self.label_values + [str(i)], v)
        else:
            fam.add_metric(self.label_values, value)
        return fam


def make_compat(mode: str, registry: CollectorRegistry, model: str, max_model_len: int,
                snapshot: Callable[[], dict[str, Any] | None]) -> VllmCompat | None:
    """The compat series for `mode` registered on `registry`: None for "none"; ValueError for a
    mode not in METRICS_COMPAT_CHOICES."""
    if mode == "none":
        return None
    if mode == "vllm":
        return VllmCompat(registry, model, max_model_len, snapshot)
    raise ValueError(f"metrics compat must be one of {', '.join(METRICS_COMPAT_CHOICES)}; got {mode!r}")

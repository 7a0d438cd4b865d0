"""Issue 19, "Grafana and Prometheus": the dashboard, the scrape config and `--metrics-compat vllm`
against real `kvtier serve` processes.

Oracles: the live /metrics of a server with G2 and G3 tiers after it served a prompt, a flood
that pushed it out of G1, and the prompt again (so every tier series has moved); the PromQL of
every panel of deploy/grafana/kvtier.json; and the metric names vLLM's own published dashboard queries
(vllm-project/vllm, examples/online_serving/prometheus_grafana/grafana.json at commit
004f771f3a6b49597546b05c7d83686d1e121fa0), written out below."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving import start_server

from checkpoints import random_prompt

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvtier.json"
PROMETHEUS = REPO / "deploy" / "prometheus.yml"
G1_BLOCKS = 16  # 256 tokens: the 224-token flood pushes the 160-token prompt out of G1 into G2
LONG, FLOOD = random_prompt(160, 1901), random_prompt(224, 1902)

# Every series vLLM's published dashboard queries (the file named in the module docstring).
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# The ones kvtier cannot fill with the same meaning (server/metrics_compat.py says the same, longer).
VLLM_NOT_EXPORTED: dict[str, str] = {}  # every family the dashboard queries is exported
# vLLM's time-to-first-token buckets (vllm/v1/metrics/loggers.py), to check the bucket semantics.
VLLM_TTFT_LE = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0, float("inf")]
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset"}


def serve_and_scrape(ckpt: Path, disk: Path, *flags: str) -> str:
    """/metrics of a server with G2 and G3 after the prompt, the flood and the prompt again."""
    srv = start_server(str(ckpt), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
                       "--kv-offloading-size", "0.05", "--kv-offload-disk", str(disk), "--kv-offload-disk-size", "0.1",
                       *flags)
    try:
        with srv.client() as c:
            for prompt in (LONG, FLOOD, LONG):
                r = c.post("/v1/completions", json={"model": srv.model, "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
            text = c.get("/metrics").text
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    return text


@pytest.fixture(scope="module")
def plain_metrics(ckpt_dir, tmp_path_factory) -> str:
    return serve_and_scrape(ckpt_dir("llama"), tmp_path_factory.mktemp("g3"))


@pytest.fixture(scope="module")
def compat_metrics(ckpt_dir, tmp_path_factory) -> str:
    return serve_and_scrape(ckpt_dir("llama"), tmp_path_factory.mktemp("g3"), "--metrics-compat", "vllm")


def samples(text: str) -> dict[str, list]:
    """Sample name (`_total`, `_bucket`... included) -> its samples, from an exposition."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(s.value for s in samples(text).get(name, []) if labels.items() <= s.labels.items())


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers that are not functions,
    keywords, label names (in matchers or by/without lists), durations or $variables."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\{?\w+\}?", " ", e)
    e = re.sub(r"\b\d[\w.]*", " ", e)  # numbers and durations ("0.9", "5m")
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group() not in PROMQL_KEYWORDS and not e[m.end():].lstrip().startswith("("):
            names.add(m.group())
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(a:b_bucket{x="y{z}"}[$__rate_interval])))') \
        == {"a:b_bucket"}
    assert metric_names("sum(rate(a_total[5m])) / sum by (tier, direction) (b offset 5m)") == {"a_total", "b"}


def test_every_panel_queries_series_a_live_server_has(plain_metrics):
    have = samples(plain_metrics)
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            for name in names:
                assert name.startswith("kvtier:") and name in have, (panel["title"], name)
                if name.endswith("_bucket"):  # histogram_quantile's input: a histogram's buckets
                    assert any("le" in s.labels for s in have[name]), name
    # The G2 round trip moved the tier series the panels show.
    assert value(plain_metrics, "kvtier:offload_hit_tokens_total", tier="G2") > 0
    assert value(plain_metrics, "kvtier:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert 0 < value(plain_metrics, "kvtier:offload_blocks", tier="G2") <= \
        value(plain_metrics, "kvtier:offload_capacity_blocks", tier="G2")
    assert value(plain_metrics, "kvtier:kv_cache_capacity_blocks") == G1_BLOCKS
    assert 0 < value(plain_metrics, "kvtier:offload_used_bytes", tier="G3") <= \
        value(plain_metrics, "kvtier:offload_capacity_bytes", tier="G3")


def test_no_vllm_series_without_compat(plain_metrics):
    assert "vllm:" not in plain_metrics


def test_vllm_dashboard_series_with_compat(compat_metrics):
    from server.metrics_compat import VLLM_METRICS, Exported, NotExported

    have = samples(compat_metrics)
    for series in VLLM_DASHBOARD_SERIES:
        family = re.sub(r"_(bucket|sum|count|total)$", "", series)
        if family in VLLM_NOT_EXPORTED:
            assert isinstance(VLLM_METRICS[family], NotExported) and series not in have, series
        else:
            assert isinstance(VLLM_METRICS[family], Exported) and series in have, series
    dashboard_families = {re.sub(r"_(bucket|sum|count|total)$", "", s) for s in VLLM_DASHBOARD_SERIES}
    assert {f for f in dashboard_families if isinstance(VLLM_METRICS[f], NotExported)} == set(VLLM_NOT_EXPORTED)
    # vLLM's labels (its dashboard's model_name variable reads them off every vllm: series) and buckets.
    model = next(s.labels["model_name"] for s in have["kvtier:num_requests_running"])
    for name, rows in have.items():
        if name.startswith("vllm:"):
            assert all(s.labels["model_name"] == model and s.labels["engine"] == "0" for s in rows), name
    assert sorted(float(s.labels["le"]) for s in have["vllm:time_to_first_token_seconds_bucket"]) == VLLM_TTFT_LE
    # Computed from the same inputs as kvtier's own series.
    for vllm_name, kvtier_name in [
            ("vllm:e2e_request_latency_seconds_count", "kvtier:e2e_request_latency_seconds_count"),
            ("vllm:time_to_first_token_seconds_sum", "kvtier:time_to_first_token_seconds_sum"),
            ("vllm:prompt_tokens_total", "kvtier:prompt_tokens_total"),
            ("vllm:generation_tokens_total", "kvtier:generation_tokens_total"),
            ("vllm:gpu_cache_usage_perc", "kvtier:kv_cache_usage_perc")]:
        assert value(compat_metrics, vllm_name) == value(compat_metrics, kvtier_name), vllm_name
    assert value(compat_metrics, "vllm:request_success_total", finished_reason="length") == 3
    # The phases come from the core's clock, the gaps from the API's: every request has them.
    n = value(compat_metrics, "vllm:e2e_request_latency_seconds_count")
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_max_num_generation_tokens"):
        assert value(compat_metrics, name + "_count") == n, name
    assert value(compat_metrics, "vllm:request_prefill_time_seconds_sum") <= \
        value(compat_metrics, "vllm:request_inference_time_seconds_sum") <= \
        value(compat_metrics, "vllm:e2e_request_latency_seconds_sum")
    assert value(compat_metrics, "vllm:inter_token_latency_seconds_count") > 0
    assert value(compat_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == \
        value(compat_metrics, "kvtier:prompt_tokens_by_source_total", source="external_kv_transfer") > 0


def test_dashboard_json_is_complete():
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    ids = [p["id"] for p in d["panels"]]
    assert d["panels"] and len(ids) == len(set(ids))
    for panel in d["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}" and target["refId"], panel["title"]
            assert '{model_name="$model_name"' in target["expr"], (panel["title"], target["expr"])


def test_prometheus_config_scrapes_metrics():
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = [j for j in cfg["scrape_configs"] if j.get("metrics_path", "/metrics") == "/metrics"]
    assert jobs and all(t for j in jobs for sc in j["static_configs"] for t in sc["targets"])
    text = PROMETHEUS.read_text()
    assert "--metrics-no-auth" in text and "--api-key" in text

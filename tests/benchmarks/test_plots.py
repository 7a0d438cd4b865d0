"""benchmarks/_plots.py draws each benchmark's JSON as a PNG beside it. The benchmarks take minutes,
so these tests feed it small synthetic results shaped like what each script writes, and check that
a real PNG comes out (magic bytes, IHDR dimensions, matplotlib can read it back). Without
matplotlib (an optional extra, `.[bench]`) the drawing tests skip; the import-time contract
(stdlib only, a one-line skip instead of a crash) is checked either way."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import load_script

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


plots = load_script("_plots.py", "bench_plots")


# -- synthetic results, shaped like each script's JSON ------------------------------------------------
def _machine() -> dict[str, Any]:
    return {"cpu_model": "Test CPU", "usable_cpus": 2}


def policies_doc() -> dict[str, Any]:
    def trace(name: str, unbounded: float) -> dict[str, Any]:
        results = []
        for i, cap in enumerate((2048, 8192, 32768)):
            for policy, rate in (("lru", 0.1), ("priority[depth]", 0.05), ("turn_lru", 0.12), ("belady", 0.3)):
                results.append({"policy": policy, "spec": policy, "priority_mode": "uniform", "capacity": cap,
                                "fraction": cap / 50000, "hits": 1, "refs": 10,
                                "hit_rate": min(unbounded, rate * (i + 1)), "ops": 100, "seconds": 0.1,
                                "ops_per_s": 1000.0})
        return {"trace": name, "requests": 100, "session_hints": 0, "block_refs": 1000, "distinct_blocks": 500,
                "unbounded_hit_rate": unbounded, "results": results}

    return {"benchmark": "policies", "python": "3.11", "argv": ["--capacities", "2048,8192,32768"],
            "traces": [trace("/x/mooncake_synthetic.jsonl", 0.64), trace("multiturn", 0.38)]}


def throughput_doc() -> dict[str, Any]:
    def engine(tok_s: float) -> dict[str, Any]:
        runs = [{"wall_s": 10.0, "output_tok_s": tok_s * f, "total_tok_s": tok_s * 3 * f} for f in (0.97, 1.0, 1.02)]
        return {"config": "x", "runs": runs, "median_output_tok_s": tok_s, "median_total_tok_s": 3 * tok_s}

    return {"benchmark": "throughput", "created_utc": "2026-11-25T00:00:00+00:00",
            "argv": ["benchmarks/throughput.py", "--runs", "3"], "machine": _machine(),
            "workload": {"num_requests": 64, "prompt_tokens": 19031, "output_tokens": 8546, "dtype": "float32",
                         "threads": 2, "hf_batch_sizes": [16, 32]},
            "engines": {"kvtier": engine(73.5), "transformers bs=16": engine(32.9),
                        "transformers bs=32": engine(32.5), "vllm": engine(70.1)},
            "best_transformers": "transformers bs=16", "ratios": {}, "target_ratio": 2.0, "skipped": {}}


def offload_doc() -> dict[str, Any]:
    runs = {}
    for n, cold in ((1000, 2.27), (4000, 10.8), (8000, 25.0)):
        med = {"cold": cold, "G1": 0.09 * n / 1000, "G2": 0.1 * n / 1000, "G3": 0.12 * n / 1000, "G4": 0.2 * n / 1000}
        runs[str(n)] = {"ttft_s": {k: [v] for k, v in med.items()}, "median_s": med,
                        "hit_tokens": {k: n - 8 for k in ("G1", "G2", "G3", "G4")}}
    return {"benchmark": "offload", "argv": ["benchmarks/offload.py", "--runs", "1"], "machine": _machine(),
            "lengths": [1000, 4000, 8000], "offload_block_size": 16, "runs": runs}


def serve_doc() -> dict[str, Any]:
    def run(scale: float) -> dict[str, Any]:
        reqs = [{"index": i, "prompt_tokens": 100 + 30 * i, "output_tokens": 4, "cached_tokens": 0,
                 "ttft_s": scale * (0.05 + 0.01 * i), "tpot_s": 0.03, "latency_s": 1.0} for i in range(20)]
        return {"ttft_p50_s": scale * 0.15, "ttft_p99_s": scale * 0.3, "hit_tokens": {"G1": 100, "G2": 50},
                "requests": reqs}

    med = {"off": {"ttft_p50_s": 0.35, "ttft_p99_s": 1.5, "G1_hit_tokens": 13248, "G2_hit_tokens": 0,
                   "G3_hit_tokens": 0},
           "on": {"ttft_p50_s": 0.07, "ttft_p99_s": 1.4, "G1_hit_tokens": 13248, "G2_hit_tokens": 19376,
                  "G3_hit_tokens": 0}}
    return {"benchmark": "serve", "argv": ["benchmarks/serve.py"], "runs": {"off": [run(2.0)], "on": [run(0.5)]},
            "median": med, "ttft_p50_ratio_off_on": 5.0}


def serve_policies_doc() -> dict[str, Any]:
    med = {p: {"ttft_p50_s": t, "ttft_p99_s": 10 * t, "req_per_s": 0.5, "G1_hit_tokens": 5000.0,
               "G2_hit_tokens": g2} for p, t, g2 in (("lru", 1.4, 100.0), ("turn_lru", 1.2, 900.0))}
    return {"benchmark": "serve_policies", "argv": ["--runs", "1"], "workload": {"requests": 87},
            "g1_blocks": 253, "g2_gib": 0.35, "runs": {p: [{}] for p in med}, "median": med}


def spec_decode_doc() -> dict[str, Any]:
    results = {}
    for w in ("grounded", "chat"):
        for b in (1, 16):
            for name, vs in (("off", 1.0), ("ngram", 1.6 if w == "grounded" else 0.95)):
                results[f"{w}/{b}/{name}"] = {"tok_s": [10 * vs], "median_tok_s": 10 * vs, "vs_off": vs,
                                              "identical_to_off": not (w == "chat" and b == 16)}
    return {"benchmark": "spec_decode", "specs": {"off": None, "ngram": {"method": "ngram"}}, "results": results}


def fleet_doc() -> dict[str, Any]:
    def run(p50: float) -> dict[str, Any]:
        reqs = [{"index": i, "prompt_tokens": 200 + 10 * i, "output_tokens": 4, "ttft_s": p50 * (0.5 + i / 10),
                 "replica": i % 2, "cached_by_tier": {"G1": 96}} for i in range(12)]
        return {"ttft_p50_s": p50, "ttft_p99_s": 4 * p50, "requests": reqs}

    modes = {"rr": (2.0, 0.0), "rr_g4": (0.9, 900.0), "cache_aware_g4": (0.8, 300.0), "kv_aware_g4": (0.6, 100.0),
             "pd_g4": (1.5, 3000.0)}
    med = {m: {"ttft_p50_s": t, "ttft_p99_s": 4 * t, "req_per_s": 0.5, "out_tok_per_s": 2.0, "hit_rate": 0.5,
               "g4_bytes_read": g4 * 46080, "prompt_tokens": 9000.0, "G1_hit_tokens": 4000.0, "G2_hit_tokens": 50.0,
               "G4_hit_tokens": g4, "same_replica": None if m == "pd_g4" else 0.5} for m, (t, g4) in modes.items()}
    return {"benchmark": "fleet", "argv": ["benchmarks/fleet.py"], "machine": _machine(),
            "workload": {"requests": 12, "conversations": 4}, "runs": {m: [run(t)] for m, (t, _) in modes.items()},
            "median": med, "target": {"ttft_p50_rr_over_kv_aware": 3.3, "ttft_p50_cache_aware_over_kv_aware": 1.3}}


DOCS = {"policies": policies_doc, "throughput": throughput_doc, "offload": offload_doc, "serve": serve_doc,
        "serve_policies": serve_policies_doc, "spec_decode": spec_decode_doc, "fleet": fleet_doc}


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which a valid PNG has right after the magic bytes."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC, "not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


# -- tests ---------------------------------------------------------------------------------------------
def test_every_plot_has_a_synthetic_case() -> None:
    assert set(DOCS) == set(plots.PLOTS)


@pytest.mark.parametrize("name", sorted(DOCS))
def test_plot_writes_png_beside_json(name: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib import image

    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(DOCS[name]()))
    out = plots.plot_file(src)
    assert out == tmp_path / f"{name}.png"
    assert out.stat().st_size > 10_000  # an empty figure is ~2-5 KB
    width, height = _png_size(out)
    assert 400 <= width <= 3000 and 200 <= height <= 2000
    assert image.imread(out).shape[:2] == (height, width)


def test_benchmark_key_falls_back_to_file_stem(tmp_path: Path) -> None:
    """Results written before the scripts recorded "benchmark" still dispatch by their file name."""
    pytest.importorskip("matplotlib")
    doc = serve_policies_doc()
    del doc["benchmark"]
    src = tmp_path / "serve_policies.json"
    src.write_text(json.dumps(doc))
    assert plots.plot_file(src) == tmp_path / "serve_policies.png"


def test_cli_rerenders_from_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    src = tmp_path / "run.json"  # the key, not the name, picks the plot
    src.write_text(json.dumps(throughput_doc()))
    assert plots.main([str(src)]) == 0
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG_MAGIC


def test_bad_result_is_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A benchmark calls plot_file after writing its JSON: a plot problem must not lose the run."""
    unknown = tmp_path / "mystery.json"
    unknown.write_text(json.dumps({"benchmark": "mystery"}))
    broken = tmp_path / "policies.json"
    broken.write_text(json.dumps({"benchmark": "policies"}))  # no "traces"
    assert plots.plot_file(unknown) is None
    assert plots.plot_file(broken) is None
    assert plots.main([str(unknown)]) == 1
    assert "plot skipped" in capsys.readouterr().err


def test_missing_matplotlib_skips_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(plots, "_pyplot", lambda: None)  # as when the import fails
    src = tmp_path / "policies.json"
    src.write_text(json.dumps(policies_doc()))
    assert plots.plot_file(src) is None
    assert not (tmp_path / "policies.png").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib is not installed" in err[0] and ".[bench]" in err[0]


def test_import_is_stdlib_only() -> None:
    """throughput.py's vLLM worker shares benchmarks/ on another venv: _plots must import anywhere."""
    source = (REPO / "benchmarks" / "_plots.py").read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top_level if "matplotlib" in line]

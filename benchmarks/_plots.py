#!/usr/bin/env python3
"""PNG plots of the benchmarks' JSON results, one per result file, written beside it (X.json ->
X.png). Each plot takes the dict the benchmark wrote, exactly as it is on disk, so a plot can be
redrawn from an old result without rerunning anything:

    .venv/bin/python benchmarks/_plots.py benchmarks/results/policies.json [more.json ...]

The JSON's "benchmark" key picks the plot (the file's stem when a result predates the key).

matplotlib is an optional extra (`pip install -e '.[bench]'`, which the Makefile's bench-*
targets run): it is imported only when a plot is drawn, with the Agg backend (no display), and
when it is missing the plot is skipped with one line saying so; a benchmark never fails for it.
Stdlib only at import time, like _common.
"""
from __future__ import annotations

import json
import math
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install -e '.[bench]' (or make bench-setup)"
TIER_COLORS = {"cold": "#7f7f7f", "G1": "#1f77b4", "G2": "#2ca02c", "G3": "#ff7f0e", "G4": "#9467bd"}
Doc = dict[str, Any]


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # benchmarks run headless; never try to open a window
    import matplotlib.pyplot as plt

    return plt


def _command(doc: Doc, name: str) -> str:
    """The command line that produced `doc`, for the figure's footer: the plot names its own source."""
    argv = [str(a) for a in doc.get("argv") or []]
    if argv and argv[0].endswith(".py"):  # write_json records sys.argv, some scripts argv[1:]
        argv = argv[1:]
    when = f"  ({doc['created_utc']})" if doc.get("created_utc") else ""
    return " ".join([f"benchmarks/{name}.py", *argv]) + when


def _finish(plt: Any, fig: Any, doc: Doc, name: str, title: str, out: Path) -> Path:
    """Title, a footer with the command (wrapped) and the CPU, then save and close."""
    fig.suptitle(title, fontsize=12)
    footer = textwrap.fill(_command(doc, name), 140)
    cpu = (doc.get("machine") or {}).get("cpu_model")
    if cpu:
        footer += f"\n{cpu}, {doc['machine'].get('usable_cpus', '?')} usable cores"
    fig.text(0.01, 0.01, footer, fontsize=7, color="#555555", va="bottom", ha="left", family="monospace")
    lines = footer.count("\n") + 1
    fig.tight_layout(rect=(0, 0.02 + 0.035 * lines, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# -- one function per benchmark: (pyplot, doc, out path) -> out path ------------------------------
def plot_policies(plt: Any, doc: Doc, out: Path) -> Path:
    """Block hit rate vs capacity (log2), one line per policy, one panel per trace; Belady's MIN
    dashed and the unbounded cache's hit rate as a horizontal line: the ceilings a policy is judged by."""
    traces = doc["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(6.2 * len(traces), 4.6), squeeze=False)
    for ax, tr in zip(axes[0], traces):
        by_policy: dict[str, list[tuple[int, float]]] = {}
        for r in tr["results"]:
            by_policy.setdefault(r["policy"], []).append((r["capacity"], r["hit_rate"]))
        for i, (label, pts) in enumerate(by_policy.items()):
            pts.sort()
            xs, ys = [p[0] for p in pts], [100 * p[1] for p in pts]
            if label == "belady":
                ax.plot(xs, ys, "--", color="black", label="Belady MIN (offline)")
                continue
            # Each later line thinner, with a smaller marker of another shape: policies that tie
            # (turn_lru is LRU on a trace without session hints) stay visible on top of each other.
            ax.plot(xs, ys, "-", marker="osD^v<>"[i % 7], ms=max(2.5, 7 - 1.5 * i), lw=max(1.0, 3 - 0.7 * i),
                    label=label)
        ax.axhline(100 * tr["unbounded_hit_rate"], color="#999999", lw=1, ls=":",
                   label=f"unbounded cache ({tr['unbounded_hit_rate']:.1%})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("block hit rate (%)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{Path(tr['trace']).stem}: {tr['requests']:,} requests, "
                     f"{tr['distinct_blocks']:,} distinct blocks", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return _finish(plt, fig, doc, "policies", "Eviction policies: hit rate vs capacity", out)


def plot_throughput(plt: Any, doc: Doc, out: Path) -> Path:
    """Output tok/s per engine (median bar, min-max whisker over runs); peers the run skipped are
    listed under the bars, so a chart without vLLM says why."""
    engines = doc["engines"]
    names = list(engines)
    med = [engines[n]["median_output_tok_s"] for n in names]
    lo = [m - min(r["output_tok_s"] for r in engines[n]["runs"]) for n, m in zip(names, med)]
    hi = [max(r["output_tok_s"] for r in engines[n]["runs"]) - m for n, m in zip(names, med)]
    colors = ["#1f77b4" if n.startswith("kvtier") else "#ff7f0e" if n.startswith("transformers")
              else "#2ca02c" for n in names]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.55 * len(names)))
    y = list(range(len(names)))[::-1]  # first engine (kvtier) on top
    ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
    kv = engines.get("kvtier", {}).get("median_output_tok_s")
    for yi, n, m, h in zip(y, names, med, hi):
        rel = f"  ({m / kv:.2f}× kvtier)" if kv and n != "kvtier" else ""
        ax.text(m + h, yi, f"  {m:,.1f}{rel}", va="center", ha="left", fontsize=8)  # right of the whisker
    ax.set_yticks(y, [f"{n} ({len(engines[n]['runs'])} runs)" for n in names], fontsize=8)
    ax.set_xlabel("output tokens/s (median; whiskers: min-max over runs)")
    ax.set_xlim(0, max(m + h for m, h in zip(med, hi)) * 1.3)
    wl = doc.get("workload") or {}
    skipped_by = dict(doc.get("skipped") or {})
    if not any(n.startswith("transformers") for n in names) and not wl.get("hf_batch_sizes"):
        skipped_by["transformers"] = "not run (--hf-batch-sizes none)"
    skipped = "; ".join(f"{k}: {v}" for k, v in skipped_by.items())
    ax.set_title(f"{wl.get('num_requests', '?')} requests, {wl.get('prompt_tokens', 0):,} prompt + "
                 f"{wl.get('output_tokens', 0):,} output tokens, {wl.get('dtype', '')}, "
                 f"{wl.get('threads', '?')} threads" + (f"\n{textwrap.shorten(skipped, 110)}" if skipped else ""),
                 fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return _finish(plt, fig, doc, "throughput", "Offline throughput against peers", out)


def plot_offload(plt: Any, doc: Doc, out: Path) -> Path:
    """TTFT per tier (cold prefill, G1..G4 hits) vs prompt length, and each hit's speedup over cold."""
    lengths = sorted(int(n) for n in doc["runs"])
    medians = [doc["runs"][str(n)]["median_s"] for n in lengths]
    modes = [m for m in TIER_COLORS if m in medians[0]]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for m in modes:
        label = "cold prefill" if m == "cold" else f"{m} hit"
        ax.plot(lengths, [md[m] for md in medians], marker="o", color=TIER_COLORS[m], label=label)
        if m != "cold" and "cold" in medians[0]:  # --no-cold runs have no speedups
            ax2.plot(lengths, [md["cold"] / md[m] for md in medians], marker="o", color=TIER_COLORS[m], label=label)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s, median)")
    ax2.set_ylabel("speedup over cold prefill (×)")
    for a in (ax, ax2):
        a.set_xlabel("prompt tokens")
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    ax.set_title("time to first token", fontsize=9)
    ax2.set_title(f"hit vs cold ({doc.get('offload_block_size', '?')}-token offload blocks)", fontsize=9)
    return _finish(plt, fig, doc, "offload", "TTFT by tier vs prompt length", out)


def plot_serve(plt: Any, doc: Doc, out: Path) -> Path:
    """Per-request TTFT against prompt length, offload off vs on (every run), and the prompt tokens
    each tier served (medians over runs)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [2, 1]})
    colors = {"off": "#d62728", "on": "#2ca02c"}
    for mode, runs in doc["runs"].items():
        reqs = [r for run in runs for r in run.get("requests", [])]
        ax.scatter([r["prompt_tokens"] for r in reqs], [r["ttft_s"] for r in reqs], s=12, alpha=0.6,
                   color=colors.get(mode), label=f"offload {mode} (p50 {doc['median'][mode]['ttft_p50_s']:.3f} s)")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT per request (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("every request of every run", fontsize=9)
    _stacked_hits(ax2, doc["median"])
    ratio = doc.get("ttft_p50_ratio_off_on")
    title = "Serving with KV offload off vs on" + (f": p50 TTFT off/on {ratio:.1f}×" if ratio else "")
    return _finish(plt, fig, doc, "serve", title, out)


def _stacked_hits(ax: Any, medians: dict[str, dict[str, float]]) -> None:
    """Stacked bars of the prompt tokens each tier served, one bar per mode (keys `<tier>_hit_tokens`)."""
    modes = list(medians)
    tiers = sorted({k[: -len("_hit_tokens")] for m in medians.values() for k in m if k.endswith("_hit_tokens")})
    bottom = [0.0] * len(modes)
    for t in tiers:
        vals = [medians[m].get(f"{t}_hit_tokens", 0.0) for m in modes]
        ax.bar(modes, vals, bottom=bottom, color=TIER_COLORS.get(t), label=t)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("prompt tokens served from cache (median)")
    # Headroom for the totals and the legend (set by hand: a zero-height bar on top of a stack pins
    # autoscaling's margin at the stack's top).
    ax.set_ylim(0, 1.25 * max(bottom, default=0.0) or 1.0)
    ax.legend(fontsize=8, loc="upper center", ncols=max(1, len(tiers)))
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("hit tokens by tier", fontsize=9)


def _median_bars(ax: Any, medians: dict[str, dict[str, float]], runs: dict[str, list[Doc]], key: str,
                 label: str) -> None:
    """One bar per mode (the median of `key`) with every run as a dot: with 2-3 runs on a shared
    machine one slow run moves the median, and the dots show it."""
    modes = list(medians)
    ax.bar(range(len(modes)), [medians[m][key] for m in modes], 0.6, color="#aec7e8")
    for x, m in enumerate(modes):
        per_run = [r[key] for r in runs.get(m, []) if key in r]
        ax.plot([x] * len(per_run), per_run, "k.", ms=6, label="one run" if x == 0 else None)
    ax.set_xticks(range(len(modes)), [f"{m}\n{medians[m][key]:.3f} s" for m in modes])
    ax.set_ylabel(f"{label} (s)")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{label}: median bar, runs as dots", fontsize=9)


def plot_serve_policies(plt: Any, doc: Doc, out: Path) -> Path:
    """TTFT p50 and p99 and the tokens each tier served, per eviction policy (medians over runs)."""
    med = doc["median"]
    fig, (ax50, ax99, ax_hits) = plt.subplots(1, 3, figsize=(13, 4.4))
    _median_bars(ax50, med, doc["runs"], "ttft_p50_s", "TTFT p50")
    _median_bars(ax99, med, doc["runs"], "ttft_p99_s", "TTFT p99")
    _stacked_hits(ax_hits, med)
    runs = len(next(iter(doc["runs"].values()), []))
    wl = doc.get("workload") or {}
    rates = ", ".join(f"{p} {m['req_per_s']:.2f}" for p, m in med.items())
    title = (f"Eviction policy in G1 and G2, kvtier serve: {wl.get('requests', '?')} requests, "
             f"G1 {doc.get('g1_blocks', '?')} blocks, G2 {doc.get('g2_gib', 0):.3f} GiB, {runs} run(s); "
             f"req/s {rates}")
    return _finish(plt, fig, doc, "serve_policies", title, out)


def plot_fleet(plt: Any, doc: Doc, out: Path) -> Path:
    """Per routing mode: every request's TTFT as a CDF, the TTFT p50 (median bar, runs as dots) and
    the prompt tokens each tier served, summed over the replicas."""
    med = doc["median"]
    fig, (ax_cdf, ax50, ax_hits) = plt.subplots(1, 3, figsize=(15, 4.6))
    for mode, runs in doc["runs"].items():
        ttft = sorted(r["ttft_s"] for run in runs for r in run.get("requests", []))
        if ttft:
            ax_cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=mode)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (s)")
    ax_cdf.set_ylabel("share of requests")
    ax_cdf.grid(alpha=0.3, which="both")
    ax_cdf.legend(fontsize=8)
    ax_cdf.set_title("TTFT of every request, every run", fontsize=9)
    _median_bars(ax50, med, doc["runs"], "ttft_p50_s", "TTFT p50")
    ax50.tick_params(axis="x", labelsize=7)
    _stacked_hits(ax_hits, med)
    ax_hits.tick_params(axis="x", labelsize=7)
    target = doc.get("target") or {}
    vs_rr = target.get("ttft_p50_rr_over_kv_aware")
    wl = doc.get("workload") or {}
    title = (f"Routing a 2-replica kvtier fleet (vllm-router, Redis Cluster G4): {wl.get('requests', '?')} requests "
             f"of {wl.get('conversations', '?')} conversations")
    if vs_rr:
        title += f"; TTFT p50 rr / kv_aware_g4 {vs_rr:.2f}×"
    return _finish(plt, fig, doc, "fleet", title, out)


def plot_spec_decode(plt: Any, doc: Doc, out: Path) -> Path:
    """Output tok/s relative to no speculation, per workload and batch size, one bar per engine;
    a bar whose tokens differed from `off`'s is hatched (speculation must not change greedy output)."""
    cases: dict[str, dict[str, dict[str, Any]]] = {}
    for key, r in doc["results"].items():
        workload, batch, engine = key.split("/", 2)
        if engine != "off":
            cases.setdefault(f"{workload}\nbatch {batch}", {})[engine] = r
    engines = sorted({e for c in cases.values() for e in c})
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cases) + 2), 4.4))
    for i, eng in enumerate(engines):
        xs = [c + (i - (len(engines) - 1) / 2) * width for c in range(len(cases))]
        rs = [case.get(eng) for case in cases.values()]
        vals = [r["vs_off"] if r else math.nan for r in rs]
        bars = ax.bar(xs, vals, width, label=eng)
        for bar, r, v in zip(bars, rs, vals):
            if r is None:
                continue
            if not r.get("identical_to_off", True):
                bar.set_hatch("//")
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}×", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_xticks(range(len(cases)), list(cases), fontsize=8)
    ax.set_ylabel("output tok/s vs no speculation (×)")
    ax.margins(y=0.12)  # room for the labels above the bars
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _finish(plt, fig, doc, "spec_decode", "Speculative decoding speedup (hatched: output differs)", out)


PLOTS: dict[str, Callable[[Any, Doc, Path], Path]] = {
    "policies": plot_policies,
    "throughput": plot_throughput,
    "offload": plot_offload,
    "serve": plot_serve,
    "serve_policies": plot_serve_policies,
    "spec_decode": plot_spec_decode,
    "fleet": plot_fleet,
}


# -- entry points ---------------------------------------------------------------------------------
def benchmark_of(doc: Doc, path: Path) -> str:
    """Which plot a result gets: its "benchmark" key, else the file's stem (older results)."""
    return str(doc.get("benchmark") or path.stem)


def render(doc: Doc, out: Path, benchmark: str) -> Path | None:
    """Draw `doc` as `benchmark`'s plot into `out`; None (and one line on stderr) when matplotlib is
    missing. Errors in the data raise: callers that must not fail use `plot_file`."""
    if benchmark not in PLOTS:
        raise ValueError(f"no plot for benchmark {benchmark!r} (plots: {', '.join(PLOTS)})")
    plt = _pyplot()
    if plt is None:
        print(f"plot skipped: matplotlib is not installed; {INSTALL_HINT}", file=sys.stderr)
        return None
    try:
        return PLOTS[benchmark](plt, doc, out)
    finally:
        plt.close("all")  # a plot that failed half-way leaves no figure behind


def plot_file(json_path: str | Path) -> Path | None:
    """Redraw the PNG beside a result file (X.json -> X.png). What a benchmark calls right after
    writing its JSON: a malformed result or an unwritable PNG is reported in one line, never raised,
    so the run it follows is not lost."""
    path = Path(json_path)
    try:
        doc = json.loads(path.read_text())
        out = render(doc, path.with_suffix(".png"), benchmark_of(doc, path))
    except (OSError, ValueError, KeyError, TypeError, IndexError, ZeroDivisionError) as e:
        print(f"plot skipped for {path}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    if out is not None:
        print(f"wrote {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python benchmarks/_plots.py RESULT.json...`: exit 1 if any plot could not be drawn."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths or any(p in ("-h", "--help") for p in paths):
        print(__doc__)
        return 0 if paths else 2
    drawn = [plot_file(p) for p in paths]  # every file, even after one fails
    return 0 if all(out is not None for out in drawn) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Eviction policies end to end: `kvtier serve` replaying multi-turn conversations with LRU and
with turn_lru in G1 and G2, sized so that LRU thrashes; TTFT and the prompt tokens each tier served.

Workload: a conversation trace from benchmarks/traces.py, denser than its default (flags below)
so that a few minutes of CPU serving hold many returning conversations; prompts are built from
the trace's block ids as in benchmarks/serve.py (`build_workload`: every 512-token trace block
becomes B = round(512 * --scale) tokens, the same ids giving the same tokens), sent as token ids
in the trace's order, at most --concurrency in flight (closed loop). Every request carries its
conversation as `prompt_cache_key`, the session hint turn_lru ranks by (and a fresh `cache_salt`
per run, so every run starts cold).

Modes, each a fresh server per run, interleaved (lru, turn_lru, lru, ...): `--kv-eviction-policy
lru` or `turn_lru` (G1 and G2 both take it), the same G1 (--num-gpu-blocks, default room for
--concurrency of the longest requests plus 25%) and G2 (--g2-fraction of the KV bytes of the
slice's distinct blocks; it must be well above G1's, since G2 holds copies of what G1 stored).
Metrics as in benchmarks/serve.py: client-side TTFT from the stream,
hit tokens per tier from /v1/kv/stats deltas; medians over --runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import RESULTS_DIR, log, median, print_table, run_interleaved, usable_cpus, write_json  # noqa: E402
from _plots import plot_file  # noqa: E402
from serve import MIN_TOKEN_ID, Req, build_workload, hit_tokens, kv_stats, percentile, replay, start_server  # noqa: E402
from traces import TraceSpec, generate  # noqa: E402

POLICIES = ("lru", "turn_lru")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--sessions", type=int, default=60, help="conversations in the trace (default %(default)s)")
    ap.add_argument("--duration", type=float, default=300.0,
                    help="seconds over which they start (default %(default)s)")
    ap.add_argument("--think", type=float, default=60.0, help="mean think time between turns, s (default %(default)s)")
    ap.add_argument("--trace-seed", type=int, default=0, help="trace generator seed (default %(default)s)")
    ap.add_argument("--num-requests", type=int, default=96,
                    help="requests replayed, from the trace's start (default %(default)s)")
    ap.add_argument("--scale", type=float, default=1 / 32, help="trace block -> tokens factor (default 1/32)")
    ap.add_argument("--output-tokens", type=int, default=4, help="tokens each request generates (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight at most (default %(default)s)")
    ap.add_argument("--runs", type=int, default=2, help="runs per mode, interleaved (default %(default)s)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="G1 blocks (default: see above)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per G1 block (default %(default)s)")
    ap.add_argument("--g2-fraction", type=float, default=0.35,
                    help="G2 size as a fraction of the slice's distinct KV bytes (default %(default)s)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads per server")
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds for a server to start")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "serve_policies.json", help="JSON results")
    args = ap.parse_args(argv)
    if min(args.sessions, args.num_requests, args.concurrency, args.runs, args.output_tokens - 1) < 1:
        ap.error("--sessions, --num-requests, --concurrency and --runs must be >= 1, --output-tokens >= 2")
    if not 0 < args.g2_fraction <= 1 or args.scale <= 0:
        ap.error("--g2-fraction must be in (0, 1] and --scale > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model:
        model_dir = Path(args.model)
    else:
        from engine.demo.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes_per_token = cfg["num_hidden_layers"] * 2 * (cfg.get("num_key_value_heads") or
                                                        cfg["num_attention_heads"]) * head_dim * 4  # float32

    spec = TraceSpec(sessions=args.sessions, duration_s=args.duration, think_s=args.think, seed=args.trace_seed)
    trace = generate(spec)[: args.num_requests]
    wl = build_workload(list(enumerate(trace)), args.scale, 0.0, args.output_tokens, args.output_tokens,
                        cfg["vocab_size"], 0)
    sessions = {i: str(row["session"]) for i, row in enumerate(trace)}
    summary = wl.summary()
    longest = max(len(r.prompt) + r.max_tokens for r in wl.reqs)
    g1_blocks = args.num_gpu_blocks or math.ceil(1.25 * args.concurrency * longest / args.block_size)
    g2_gib = args.g2_fraction * wl.distinct_tokens * kv_bytes_per_token / 2**30
    if args.g2_fraction * wl.distinct_tokens <= 1.5 * g1_blocks * args.block_size:
        # G2 holds copies of what G1 stores: no bigger than G1, it serves nothing G1 does not
        sys.exit(f"G2 ({args.g2_fraction * wl.distinct_tokens:,.0f} tokens) must be well above G1 "
                 f"({g1_blocks * args.block_size:,} tokens) to serve hits: raise --g2-fraction or lower --num-gpu-blocks")
    log(f"workload: {summary['requests']} requests of {len(set(sessions.values()))} conversations, "
        f"{summary['prompt_tokens']:,} prompt tokens ({summary['distinct_tokens']:,} distinct), "
        f"{summary['reusable_token_fraction']:.0%} reusable with an unbounded cache; G1 {g1_blocks} blocks, "
        f"G2 {g2_gib:.3f} GiB ({args.g2_fraction:.0%} of the distinct blocks)")
    common = ["--dtype", "float32", "--block-size", str(args.block_size), "--num-gpu-blocks", str(g1_blocks),
              "--kv-offloading-size", f"{g2_gib:.4f}", "--log-level", "warning"]
    if args.model:
        common.insert(0, str(model_dir))
    mode_args = {p: [*common, "--kv-eviction-policy", p] for p in POLICIES}
    warmup = [Req(-1, [MIN_TOKEN_ID + i for i in range(64)], 2, 0)]

    def measure(mode: str, run: int) -> dict[str, Any]:
        srv = start_server(mode_args[mode], args.threads, args.start_timeout)
        try:
            asyncio.run(replay(srv.url, warmup, 1, f"warmup-{uuid.uuid4().hex}", srv.model, args.request_timeout))
            salt = f"run{run}-{uuid.uuid4().hex}"
            extras = {i: {"prompt_cache_key": f"{salt}/{s}"} for i, s in sessions.items()}
            before = kv_stats(srv.url)
            results, wall = asyncio.run(replay(srv.url, wl.reqs, args.concurrency, salt, srv.model,
                                               args.request_timeout, extras))
            after = kv_stats(srv.url)
        except BaseException:
            log(f"[{mode} run {run + 1}] failed; the server's last lines:\n{srv.tail()}")
            raise
        finally:
            srv.stop()
        ttft = [r["ttft_s"] for r in results]
        return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "wall_s": wall,
                "req_per_s": len(results) / wall, "hit_tokens": hit_tokens(before, after)}

    def progress(run: int, mode: str, m: dict[str, Any]) -> None:
        log(f"[{mode} run {run + 1}/{args.runs}] TTFT p50 {m['ttft_p50_s']:.3f}s p99 {m['ttft_p99_s']:.2f}s, "
            f"{m['req_per_s']:.2f} req/s; hit tokens " + ", ".join(f"{t} {n:,}" for t, n in m["hit_tokens"].items()))

    t0 = time.perf_counter()
    runs = run_interleaved(args.runs, {p: (lambda r, p=p: measure(p, r)) for p in POLICIES}, progress)
    med = {mode: {"ttft_p50_s": median([m["ttft_p50_s"] for m in ms]), "ttft_p99_s": median([m["ttft_p99_s"] for m in ms]),
                  "req_per_s": median([m["req_per_s"] for m in ms]),
                  **{f"{t}_hit_tokens": median([m["hit_tokens"].get(t, 0) for m in ms]) for t in ("G1", "G2")}}
           for mode, ms in runs.items()}
    print_table(["policy (G1, G2)", "TTFT p50 s", "TTFT p99 s", "req/s", "G1 hit tok", "G2 hit tok"],
                [[p, f"{m['ttft_p50_s']:.3f}", f"{m['ttft_p99_s']:.2f}", f"{m['req_per_s']:.2f}",
                  f"{int(m['G1_hit_tokens']):,}", f"{int(m['G2_hit_tokens']):,}"] for p, m in med.items()])
    path = write_json(args.out, {"benchmark": "serve_policies", "workload": {**summary, "trace_spec": asdict(spec)},
                                 "server_args": mode_args, "g1_blocks": g1_blocks, "g2_gib": g2_gib, "runs": runs,
                                 "median": med, "argv": sys.argv[1:] if argv is None else argv})
    log(f"wrote {path} ({time.perf_counter() - t0:.0f} s in all)")
    plot_file(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

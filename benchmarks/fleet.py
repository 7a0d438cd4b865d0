#!/usr/bin/env python3
"""Routing policies for a fleet of kvtier replicas: two `kvtier serve` replicas behind vllm-router
(PyPI), a 3-node Redis Cluster as their shared G4, replaying multi-turn conversations; TTFT,
throughput, the fleet's prefix hit rate and the bytes read from G4, per routing mode.

Workload: a conversation trace from benchmarks/traces.py with more turns per conversation than its
default (geometric, mean --turns; the default power law has 71% single-turn sessions, and a first
turn has nothing to route by): at the defaults 68 requests of 20 conversations, 48 of them
follow-up turns. Prompts are built from the trace's block ids as in benchmarks/serve.py
(`build_workload`: a 512-token trace block becomes B = round(512 * --scale) tokens, the same ids the
same tokens; a turn's prompt extends the previous turn's), sent as token ids to the router's
/v1/completions, streamed, greedy with ignore_eos, and a turn only once its conversation's previous
turn has answered (a user reads the answer first). Two ways to send them:
  closed loop (default)  in the trace's order, at most --concurrency in flight; later requests wait
                         behind a turn whose previous turn has not answered yet
  --speedup X            open loop: each request at its trace time divided by X (or when its
                         previous turn answers, if later), however many are in flight. X sets the
                         load: the same arrivals cost round robin more work than a prefix-aware
                         policy, so its queues grow first

Modes, each with fresh replicas, a fresh router and an emptied G4 per run (cold caches), interleaved:
  rr              --policy round_robin; replicas with G1 + G2 only: a turn that lands on the other
                  replica than its conversation's last one recomputes the prefix
  rr_g4           round_robin; replicas with G4 (--kv-offload-remote redis+cluster://...)
  cache_aware_g4  --policy cache_aware: the router's approximate prefix tree of what it routed
  kv_aware_g4     --policy kv_aware, fed by each replica's KV events (G1/G2/G4 residency)
  pd_g4           --vllm-pd-disaggregation: replica 0 prefills every prompt, replica 1 decodes it
                  after loading the prompt's KV from G4 (docs/FLEET.md)
Every replica: one torch thread (two replicas on two cores), the same G1 (--num-gpu-blocks,
default room for --concurrency of the longest requests plus 25%: about half of the slice's
distinct tokens) and G2 (--g2-fraction of the slice's distinct KV bytes; by default the whole
slice, as host memory is the big local tier: a local miss is then a turn on the wrong replica, not
an eviction), KV events on, request logging on (which replica ran which prompt, and what each
tier served of it).

No request carries cache_salt, prompt_cache_key or request_id: with any of them (even
"cache_salt": null) vllm-router 0.1.17's kv_aware credits no cached prefix (its debug log says
credited_prefix_tokens=0 for every request). Runs start cold by fresh replicas and FLUSHALL instead.

Metrics: TTFT p50/p99 from the client's stream (first chunk with text, as benchmarks/serve.py);
requests/s and output tokens/s over the run's wall time; fleet hit rate = prompt tokens not
computed (G1 prefix hits + G2 + G4 hit tokens) / prompt tokens, summed over the replicas'
/v1/kv/stats deltas (in pd_g4 every prompt is counted twice, once on each side); G4 bytes read
(tiers.G4.bytes_read deltas); "same replica": the share of follow-up turns that ran on the replica
of their conversation's previous turn (round robin: about half). kv_aware's own view is in the
JSON: of its decisions, how many credited a cached prefix. Medians over --runs. Target (reported,
not enforced): kv_aware_g4's TTFT p50 at least 2x lower than rr's, and lower than cache_aware_g4's.

--smoke runs every mode once on a tiny random checkpoint and a dozen requests, replicas at -O 0 (checks the
script).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))
sys.path.append(str(_HERE.parent / "tests"))  # checkpoints (the --smoke model)
sys.path.append(str(_HERE.parent / "tests" / "remote"))  # redis_procs, router_procs

import _fleet_procs as fp  # noqa: E402
from _common import RESULTS_DIR, log, median, print_table, ratio, run_interleaved, write_json  # noqa: E402
from _plots import plot_file  # noqa: E402
from serve import (MIN_TOKEN_ID, Req, Workload, build_workload, hit_tokens, kv_stats, one_request,  # noqa: E402
                   percentile, replay)
from traces import TraceSpec, generate  # noqa: E402

SERVED_MODEL = "fleet"  # --served-model-name of every replica, and the router's --kv-event-model
TARGET_RATIO = 2.0  # TTFT p50 rr / kv_aware_g4


@dataclass(frozen=True)
class Mode:
    policy: str  # vllm-router --policy
    g4: bool
    pd: bool = False


MODES = {"rr": Mode("round_robin", False), "rr_g4": Mode("round_robin", True),
         "cache_aware_g4": Mode("cache_aware", True), "kv_aware_g4": Mode("kv_aware", True),
         "pd_g4": Mode("round_robin", True, pd=True)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes (default: all)")
    ap.add_argument("--sessions", type=int, default=20, help="conversations in the trace (default %(default)s)")
    ap.add_argument("--duration", type=float, default=300.0,
                    help="seconds over which they start (default %(default)s)")
    ap.add_argument("--turns", type=float, default=4.0,
                    help="mean turns per conversation, geometric (default %(default)s)")
    ap.add_argument("--think", type=float, default=20.0, help="mean think time between turns, s (default %(default)s)")
    ap.add_argument("--trace-seed", type=int, default=0, help="trace generator seed (default %(default)s)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests replayed, from the trace's start (default: all of them)")
    ap.add_argument("--scale", type=float, default=1 / 32, help="trace block -> tokens factor (default 1/32)")
    ap.add_argument("--output-tokens", type=int, default=4, help="tokens each request generates (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=4,
                    help="closed loop: requests in flight at most (default %(default)s)")
    ap.add_argument("--speedup", type=float, default=None,
                    help="open loop instead: send each request at its trace time divided by this (see above)")
    ap.add_argument("--runs", type=int, default=1, help="runs per mode, interleaved (default %(default)s)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="G1 blocks per replica (default: see above)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per G1 block (default %(default)s)")
    ap.add_argument("--g2-fraction", type=float, default=1.0,
                    help="G2 per replica, a fraction of the slice's distinct KV bytes (default %(default)s)")
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="extra vllm-router argument, every mode (repeatable, e.g. --router-arg=--cache-threshold=0.5)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra `kvtier serve` argument, every replica (repeatable)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random model, 12 requests, every mode once, replicas at -O 0 unless "
                         "--server-arg chooses (checks the script)")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results (default benchmarks/results/fleet.json, fleet-smoke.json with --smoke)")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in args.modes if m not in MODES]:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; modes: {', '.join(MODES)}")
    if args.smoke:  # small enough for a test: every mode once, seconds of serving each
        args.sessions, args.duration, args.think, args.num_requests, args.runs = 6, 20.0, 5.0, 12, 1
        args.output_tokens, args.concurrency = 3, 2
        args.server_arg = ["-O", "0", *args.server_arg]  # compiling is ~5 s of each replica's start; a later -O wins
    if min(args.sessions, args.concurrency, args.runs, args.output_tokens - 1, args.num_requests or 1) < 1:
        ap.error("--sessions, --num-requests, --concurrency and --runs must be >= 1, --output-tokens >= 2")
    if not 0 < args.g2_fraction <= 1 or args.scale <= 0 or args.turns < 1:
        ap.error("--g2-fraction must be in (0, 1], --scale > 0 and --turns >= 1")
    if args.speedup is not None and args.speedup <= 0:
        ap.error("--speedup must be > 0")
    if args.out is None:
        args.out = RESULTS_DIR / ("fleet-smoke.json" if args.smoke else "fleet.json")
    return args


# -- workload and replica flags -----------------------------------------------------------------
def model_dir(args: argparse.Namespace, tmp: Path) -> Path:
    if args.smoke and not args.model:
        import checkpoints  # tests/checkpoints.py: a tiny random llama, built in half a second

        return checkpoints.build_checkpoint("llama", tmp / "model")
    if args.model:
        return Path(args.model)
    from engine.demo.demo_model import ensure_demo_model

    return ensure_demo_model()


def kv_bytes_per_token(cfg: dict[str, Any]) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 4  # float32


def workload(args: argparse.Namespace, vocab: int) -> tuple[Workload, list[str], list[float], TraceSpec]:
    """The trace slice as requests, each request's conversation and its trace time (s, from the first)."""
    spec = TraceSpec(sessions=args.sessions, duration_s=args.duration, think_s=args.think, turns_alpha=0.0,
                     turns=args.turns, seed=args.trace_seed)
    trace = generate(spec)[: args.num_requests]
    wl = build_workload(list(enumerate(trace)), args.scale, 0.0, args.output_tokens, args.output_tokens, vocab, 0)
    t0 = trace[0]["timestamp"]
    return wl, [str(row["session"]) for row in trace], [(row["timestamp"] - t0) / 1000 for row in trace], spec


async def replay_timed(url: str, reqs: list[Req], starts: list[float], after: dict[int, int], timeout: float,
                       ) -> tuple[list[dict[str, Any]], float]:
    """Open loop: request i is sent `starts[i]` seconds in (or once request `after[i]` has answered,
    if later), whatever else is in flight; results in the order of `reqs`, and the wall time."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        tasks: dict[int, asyncio.Task[dict[str, Any]]] = {}

        async def send(r: Req, at: float) -> dict[str, Any]:
            dep = tasks.get(after[r.index]) if r.index in after else None
            if dep is not None:
                await asyncio.wait([dep])  # its failure, if any, is raised by gather below
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter() - start
            out = await one_request(client, r, None, SERVED_MODEL)
            return {**out, "due_s": at, "sent_s": sent, "done_s": time.perf_counter() - start}

        for r, at in zip(reqs, starts):  # in trace order, so a turn's previous turn has its task already
            tasks[r.index] = asyncio.create_task(send(r, at))
        results = await asyncio.gather(*tasks.values())
        return list(results), time.perf_counter() - start


def previous_turns(reqs: list[Req], sessions: list[str]) -> dict[int, int]:
    """Request index -> its conversation's previous turn: a user sends a turn after reading the
    answer to the last one, whatever the concurrency lets through."""
    last: dict[str, int] = {}
    after: dict[int, int] = {}
    for r, s in zip(reqs, sessions):
        if s in last:
            after[r.index] = last[s]
        last[s] = r.index
    return after


def replica_args(args: argparse.Namespace, wl: Workload, bytes_per_token: int) -> tuple[list[str], int, float]:
    longest = max(len(r.prompt) + r.max_tokens for r in wl.reqs)
    g1_blocks = args.num_gpu_blocks or math.ceil(1.25 * args.concurrency * longest / args.block_size)
    g2_tokens = args.g2_fraction * wl.distinct_tokens
    if g1_blocks * args.block_size >= wl.distinct_tokens:
        log(f"warning: G1 ({g1_blocks * args.block_size:,} tokens) holds the whole slice "
            f"({wl.distinct_tokens:,} distinct tokens): routing cannot matter much; lower --num-gpu-blocks")
    if g2_tokens <= 1.5 * g1_blocks * args.block_size:  # G2 holds copies of what G1 stored
        log(f"note: G2 ({g2_tokens:,.0f} tokens) is not well above G1 ({g1_blocks * args.block_size:,} tokens): "
            "it will serve few hits")
    g2_gib = g2_tokens * bytes_per_token / 2**30
    flags = ["--served-model-name", SERVED_MODEL, "--dtype", "float32", "--block-size", str(args.block_size),
             "--num-gpu-blocks", str(g1_blocks), "--kv-offloading-size", f"{g2_gib:.4f}", *args.server_arg]
    return flags, g1_blocks, g2_gib


# -- one run of one mode -------------------------------------------------------------------------
def start_router(mode: Mode, replicas: list[fp.Replica], extra: list[str]) -> fp.Router:
    if mode.pd:
        return fp.start_router([], mode.policy, SERVED_MODEL, "--vllm-pd-disaggregation", "--prefill",
                               replicas[0].url, "--decode", replicas[1].url, *extra)
    # debug: kv_aware logs each decision with the prefix it credited (what fp.decisions counts)
    level = ["--log-level", "debug"] if mode.policy == "kv_aware" else []
    return fp.start_router(replicas, mode.policy, SERVED_MODEL, *level, *extra)


def warm_up(replicas: list[fp.Replica], timeout: float) -> None:
    """One request per replica, straight to it: a fresh server's first forward is slow."""
    for i, r in enumerate(replicas):
        req = Req(-1 - i, [MIN_TOKEN_ID + 7 * i + j for j in range(64)], 2, 0)
        asyncio.run(replay(r.url, [req], 1, f"warmup-{i}", SERVED_MODEL, timeout))


def measure(name: str, args: argparse.Namespace, model: Path, flags: list[str], cluster: fp.Cluster,
            wl: Workload, sessions: list[str], starts: list[float]) -> dict[str, Any]:
    mode = MODES[name]
    cluster.flush()  # what an earlier run wrote to G4 must not be this run's hits
    replica_flags = [*flags, "--kv-offload-remote", cluster.url, "--kv-offload-remote-trusted"] if mode.g4 else flags
    replicas = fp.start_replicas(model, 2, replica_flags)
    router = None
    try:
        warm_up(replicas, args.request_timeout)
        router = start_router(mode, replicas, args.router_arg)
        before = [kv_stats(r.url) for r in replicas]
        marks = [len(r.lines) for r in replicas]
        prev = previous_turns(wl.reqs, sessions)
        if args.speedup is None:
            results, wall = asyncio.run(replay(router.url, wl.reqs, args.concurrency, None, SERVED_MODEL,
                                               args.request_timeout, after=prev))
        else:
            results, wall = asyncio.run(replay_timed(router.url, wl.reqs, [t / args.speedup for t in starts], prev,
                                                     args.request_timeout))
        served = fp.wait_finished(replicas, marks, len(wl.reqs) * (2 if mode.pd else 1))
        after = [kv_stats(r.url) for r in replicas]
        routing = fp.decisions(router) if mode.policy == "kv_aware" else None
    except BaseException:
        tails = "\n".join(f"replica {i}:\n" + "".join(r.lines[-15:]) for i, r in enumerate(replicas))
        log(f"[{name}] failed; the last lines:\n{tails}" + (f"\nrouter:\n{router.log()[-3000:]}" if router else ""))
        raise
    finally:
        fp.stop_all(replicas, router)
    return summarize(mode, wl.reqs, results, wall, before, after, served, sessions, routing)


def summarize(mode: Mode, reqs: list[Req], results: list[dict[str, Any]], wall: float,
              before: list[dict[str, Any]], after: list[dict[str, Any]], served: list[fp.ServedRequest],
              sessions: list[str], routing: dict[str, Any] | None) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in results]
    hits: dict[str, int] = {}
    for b, a in zip(before, after):
        for tier, n in hit_tokens(b, a).items():
            hits[tier] = hits.get(tier, 0) + n
    prompt = sum(a["requests"]["prompt_tokens"] - b["requests"]["prompt_tokens"] for b, a in zip(before, after))
    g4_read = sum(a["tiers"]["G4"]["bytes_read"] - b["tiers"]["G4"]["bytes_read"]
                  for b, a in zip(before, after) if "G4" in a["tiers"])
    where = attribute(reqs, results, served, decode_only=mode.pd)
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "wall_s": wall,
            "req_per_s": len(results) / wall, "out_tok_per_s": sum(r["output_tokens"] for r in results) / wall,
            "prompt_tokens": prompt, "hit_tokens": hits, "hit_rate": sum(hits.values()) / prompt if prompt else 0.0,
            "g4_bytes_read": g4_read, "requests_per_replica": [sum(1 for w in where if w == i) for i in (0, 1)],
            "same_replica": None if mode.pd else same_replica_share(where, sessions),
            "kv_aware_decisions": routing, "requests": results}


def attribute(reqs: list[Req], results: list[dict[str, Any]], served: list[fp.ServedRequest],
              decode_only: bool) -> list[int | None]:
    """Which replica ran each request (by its prompt, from the replicas' request logs); each result
    gets `replica` and `cached_by_tier` (what that replica's tiers served of its prompt). In PD mode
    the decode side's entry (replica 1) is the one kept."""
    by_prompt: dict[tuple[int, ...], list[fp.ServedRequest]] = {}
    for s in served:
        if not (decode_only and s.replica == 0):
            by_prompt.setdefault(s.prompt, []).append(s)
    where: list[int | None] = []
    for r, req in zip(results, reqs):  # replay returns results in the requests' order
        entries = by_prompt.get(tuple(req.prompt))
        s = entries.pop(0) if entries else None  # a prompt sent twice matches twice, in order
        r["replica"], r["cached_by_tier"] = (s.replica, s.cached_by_tier) if s else (None, {})
        where.append(r["replica"])
    return where


def same_replica_share(where: list[int | None], sessions: list[str]) -> float | None:
    """Of the follow-up turns, the share that ran on the replica of their conversation's last turn."""
    last: dict[str, int | None] = {}
    same = total = 0
    for w, s in zip(where, sessions):
        if s in last and w is not None and last[s] is not None:
            total += 1
            same += w == last[s]
        last[s] = w
    return same / total if total else None


# -- report --------------------------------------------------------------------------------------
MEDIAN_KEYS = ("ttft_p50_s", "ttft_p99_s", "req_per_s", "out_tok_per_s", "hit_rate", "g4_bytes_read", "prompt_tokens")


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    med: dict[str, dict[str, Any]] = {}
    for mode, ms in runs.items():
        med[mode] = {k: median([m[k] for m in ms]) for k in MEDIAN_KEYS}
        for tier in ("G1", "G2", "G4"):  # the keys _plots' stacked hit bars read
            med[mode][f"{tier}_hit_tokens"] = median([m["hit_tokens"].get(tier, 0) for m in ms])
        shares = [m["same_replica"] for m in ms if m["same_replica"] is not None]
        med[mode]["same_replica"] = median(shares) if shares else None
    return med


def table(med: dict[str, dict[str, Any]]) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    print_table(["mode", "TTFT p50 s", "TTFT p99 s", "req/s", "out tok/s", "hit rate", "G4 MB read", "same replica"],
                [[mode, f"{m['ttft_p50_s']:.3f}", f"{m['ttft_p99_s']:.2f}", f"{m['req_per_s']:.2f}",
                  f"{m['out_tok_per_s']:.1f}", pct(m["hit_rate"]), f"{m['g4_bytes_read'] / 1e6:.1f}",
                  pct(m["same_replica"])] for mode, m in med.items()])


def target(med: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """kv_aware_g4's TTFT p50 against rr's (>= 2x lower) and cache_aware_g4's (lower)."""
    kv = med.get("kv_aware_g4", {}).get("ttft_p50_s")
    vs_rr = ratio(med.get("rr", {}).get("ttft_p50_s"), kv)
    vs_ca = ratio(med.get("cache_aware_g4", {}).get("ttft_p50_s"), kv)
    out = {"ttft_p50_rr_over_kv_aware": vs_rr, "ttft_p50_cache_aware_over_kv_aware": vs_ca,
           "target_ratio": TARGET_RATIO,
           "met": None if vs_rr is None or vs_ca is None else bool(vs_rr >= TARGET_RATIO and vs_ca > 1)}
    if out["met"] is None:
        print("target: not checked (needs the rr, cache_aware_g4 and kv_aware_g4 modes)")
    else:
        print(f"target: kv_aware_g4 TTFT p50 >= {TARGET_RATIO:.0f}x lower than rr (got {vs_rr:.2f}x) and lower than "
              f"cache_aware_g4 (got {vs_ca:.2f}x): {'met' if out['met'] else 'NOT met'}")
    return out


def progress(run: int, mode: str, m: dict[str, Any]) -> None:
    kv = m["kv_aware_decisions"]
    credited = f"; kv_aware credited a prefix in {kv['credited']}/{kv['decisions']} decisions" if kv else ""
    same = "-" if m["same_replica"] is None else f"{100 * m['same_replica']:.0f}%"
    log(f"[{mode} run {run + 1}] TTFT p50 {m['ttft_p50_s']:.3f}s p99 {m['ttft_p99_s']:.2f}s, "
        f"{m['req_per_s']:.2f} req/s in {m['wall_s']:.0f}s; hit rate {100 * m['hit_rate']:.0f}% (" +
        ", ".join(f"{t} {n:,}" for t, n in m["hit_tokens"].items()) +
        f"), G4 read {m['g4_bytes_read'] / 1e6:.1f} MB; per replica {m['requests_per_replica']}, "
        f"follow-ups on the same replica {same}{credited}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if fp.SERVER is None or fp.CLI is None:
        sys.exit("benchmarks/fleet.py needs redis-server and redis-cli (or valkey's) on PATH")
    if not Path(fp.ROUTER).exists():
        sys.exit(f"no vllm-router at {fp.ROUTER}: pip install -e '.[test]' (it is in the test extra)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-bench-") as tmp:
        model = model_dir(args, Path(tmp))
        cfg = json.loads((model / "config.json").read_text())
        wl, sessions, starts, spec = workload(args, cfg["vocab_size"])
        flags, g1_blocks, g2_gib = replica_args(args, wl, kv_bytes_per_token(cfg))
        summary = wl.summary()
        log(f"workload: {summary['requests']} requests of {len(set(sessions))} conversations "
            f"({summary['requests'] - len(set(sessions))} follow-up turns), {summary['prompt_tokens']:,} prompt tokens "
            f"({summary['distinct_tokens']:,} distinct, longest {summary['longest_prompt']:,}), "
            f"{summary['reusable_token_fraction']:.0%} reusable with an unbounded cache; per replica G1 {g1_blocks} "
            f"blocks, G2 {g2_gib:.3f} GiB; modes {', '.join(args.modes)}, {args.runs} run(s) each")
        cluster = fp.start_fleet_cluster()
        try:
            runs = run_interleaved(args.runs, {m: (lambda r, m=m: measure(m, args, model, flags, cluster, wl, sessions, starts))
                                               for m in args.modes}, progress)
        finally:
            cluster.stop()
    med = medians(runs)
    table(med)
    verdict = target(med)
    path = write_json(args.out, {
        "benchmark": "fleet", "workload": {**summary, "conversations": len(set(sessions)), "trace_spec": asdict(spec),
                                           "concurrency": None if args.speedup else args.concurrency,
                                           "speedup": args.speedup, "scale": args.scale, "sessions": sessions,
                                           "trace_span_s": starts[-1] / (args.speedup or 1)},
        "modes": {m: asdict(MODES[m]) for m in args.modes}, "replica_args": flags, "g1_blocks": g1_blocks,
        "g2_gib": g2_gib, "router_args": args.router_arg, "runs": runs, "median": med, "target": verdict,
        "smoke": args.smoke})
    log(f"wrote {path} ({time.perf_counter() - t0:.0f} s in all)")
    plot_file(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

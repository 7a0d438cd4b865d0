"""Serving with and without KV offload: TTFT and TPOT of `kvtier serve` on a shared-prefix
workload replayed from the Mooncake trace, G1 only against G1 + G2 (+ G3).

Workload (the trace is ../shared/traces/mooncake_synthetic.jsonl beside the checkout; see its
README): each line is one request with `input_length`, `output_length`, an arrival `timestamp` and `hash_ids`, one
id per 512-token prompt block, prefix-chained (equal ids = equal prefix blocks). The trace's
sharing is long documents (up to tens of thousands of tokens) asked about again and again, with
a different question in the last block, and with many other requests in between. By default
the benchmark takes the trace's last 64 requests (--start -64), where the trace is in its
steady state: within that slice alone 40 of the 64 requests reuse a prefix that an earlier
request of the slice brought in (66% of the prompt tokens), some right away and some after
many other documents went by. The mapping onto this CPU machine:
  - every 512-token trace block becomes B = round(512 * --scale) tokens (default 1/32: 16
    tokens, one G1 block; the slice's 18k-66k-token documents become 0.6k-2.1k-token prefixes,
    49k prompt tokens in all, and a full default run takes ~8-10 minutes on 2 idle cores);
    a request's prompt is round(input_length * B / 512) tokens (its last block partial, as in
    the trace);
  - the tokens of a block are a function of its hash id only (seeded random ids >= 100, clear
    of the special tokens), so requests that share a hash-id prefix share exactly that token
    prefix and requests that do not share one share nothing; prompts are sent as token ids to
    /v1/completions, so the token counts are exact (text would re-tokenize across blocks);
  - output tokens: round(output_length * --output-scale), clamped to [--min-output,
    --max-output]; greedy with ignore_eos, so every request generates exactly that many;
  - arrivals: requests are sent in the trace's order (timestamps only set the order: the trace's
    rate is that of a GPU cluster), at most --concurrency in flight; the next one is sent as
    soon as one finishes (closed loop).

Modes, each a `kvtier serve` subprocess (port chosen by the OS), one server at a time:
  off  G1 only, deliberately small (--num-gpu-blocks, default: room for --concurrency of the
       longest requests plus 25%), so a document's blocks are usually evicted from G1 before
       it comes back: the situation offload is for. A reuse that still finds its blocks in G1
       is a G1 hit in both modes.
  on   the same G1 plus G2 host memory (--g2-gib, default: sized to hold the slice's distinct
       blocks) and, with --g3, a G3 disk tier in a temporary directory.
Same flags otherwise (dtype, --max-num-batched-tokens, threads). Each server first answers
two warm-up requests (their own salt), which are not measured.

Metrics, client-side from the SSE stream (httpx): TTFT = request sent -> first chunk with text
(the server sends no chunk for a token that decodes to no text yet, so such a first token is
seen with the next one); TPOT = (last chunk - first chunk) / (completion_tokens - 1), with
completion_tokens from the stream's usage chunk; request throughput = requests / wall time of
the run. p50/p99 over the requests of a run (p99 of 64 requests is close to the max). Per-tier
hit tokens are the deltas of /v1/kv/stats over the run: G1 prefix_cache_hits, G2/G3 hit_tokens.
Expect a TTFT tail even with offload: a request that arrives while another one's long prompt is
being prefilled waits for that prefill, since running requests take each step's token budget
(--max-num-batched-tokens) before waiting ones are admitted (vLLM's scheduler does the same).

Runs: --runs N (default 3), interleaved (off, on, off, on, ...), a fresh server per mode and run,
and a fresh cache_salt per run: a G3 directory survives restarts, so without the salt run 2 could
hit what run 1 wrote, and every run must start cold. Medians over runs are reported; the target
(issue: offload cuts p50 TTFT by at least 3x on this workload) is checked on the ratio of the
median p50s.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import (REPO_ROOT, RESULTS_DIR, log, median, print_table, ratio, run_interleaved,  # noqa: E402
                     usable_cpus, write_json)
from _plots import plot_file  # noqa: E402
from server.launch import launch  # noqa: E402

TARGET_RATIO = 3.0  # p50 TTFT off / on (the acceptance bar)
TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the trace
MIN_TOKEN_ID = 100  # keep prompts clear of special/control tokens


# -- workload ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Req:
    index: int  # line in the trace
    prompt: list[int]
    max_tokens: int
    reused_tokens: int  # leading tokens shared with an earlier request of the slice


@dataclass
class Workload:
    reqs: list[Req]
    block_tokens: int
    distinct_tokens: int  # tokens of the distinct blocks: what a cache must hold to serve every reuse

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.reqs)

    def summary(self) -> dict[str, Any]:
        reusing = [r for r in self.reqs if r.reused_tokens]
        return {
            "requests": len(self.reqs), "trace_lines": [self.reqs[0].index, self.reqs[-1].index],
            "block_tokens": self.block_tokens, "prompt_tokens": self.prompt_tokens,
            "output_tokens": sum(r.max_tokens for r in self.reqs),
            "longest_prompt": max(len(r.prompt) for r in self.reqs), "distinct_tokens": self.distinct_tokens,
            "requests_reusing_a_prefix": len(reusing),
            "reusable_token_fraction": sum(r.reused_tokens for r in self.reqs) / self.prompt_tokens,
            "sha256": hashlib.sha256(json.dumps([[r.prompt, r.max_tokens] for r in self.reqs]).encode())
            .hexdigest()[:16],
        }


def load_trace(path: Path, start: int, n: int) -> list[tuple[int, dict[str, Any]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first = start if start >= 0 else len(rows) + start
    if not 0 <= first < len(rows):
        raise ValueError(f"--start {start} is outside the trace's {len(rows)} requests")
    picked = list(enumerate(rows))[first:first + n]
    picked.sort(key=lambda ir: (ir[1]["timestamp"], ir[0]))  # arrival order (the file is already sorted)
    return picked


def build_workload(rows: list[tuple[int, dict[str, Any]]], scale: float, output_scale: float, min_output: int,
                   max_output: int, vocab: int, seed: int) -> Workload:
    bt = max(1, round(TRACE_BLOCK * scale))
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:  # the same hash id always gives the same tokens
        if h not in blocks:
            rng = random.Random(f"{seed}:{h}")
            blocks[h] = [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(bt)]
        return blocks[h]

    reqs: list[Req] = []
    seen: set[int] = set()
    distinct: dict[int, int] = {}  # hash id -> most tokens of it in any prompt
    for i, row in rows:
        hids = row["hash_ids"]
        n = round(row["input_length"] * bt / TRACE_BLOCK)
        n = min(max(n, (len(hids) - 1) * bt + 1), len(hids) * bt)  # keep the last block non-empty and partial
        prompt = [t for h in hids for t in block(h)][:n]
        shared = 0
        while shared < len(hids) and hids[shared] in seen:
            shared += 1
        seen.update(hids)
        for j, h in enumerate(hids):
            distinct[h] = max(distinct.get(h, 0), min(bt, n - j * bt))
        out = min(max(round(row["output_length"] * output_scale), min_output), max_output)
        reqs.append(Req(i, prompt, out, min(shared * bt, n)))
    return Workload(reqs, bt, sum(distinct.values()))


# -- servers -------------------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    max_model_len: int
    lines: list[str] = field(default_factory=list)

    def tail(self, n: int = 20) -> str:
        return "".join(self.lines[-n:])

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, flushes offload writes, exits 0
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"server {self.proc.pid} did not stop in {timeout:.0f} s; killing its process group")
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the engine core goes too
            self.proc.wait(10)
            return
        if rc:
            log(f"server {self.proc.pid} exited with {rc}; its last lines:\n{self.tail()}")


def start_server(args: list[str], threads: int, timeout: float) -> Server:
    """`kvtier serve ARGS --port 0` in its own session (so a stuck one is killed with its engine
    core); returns once it prints its URL."""
    srv = launch(args, {"OMP_NUM_THREADS": str(threads)}, timeout, new_session=True)
    return Server(srv.proc, srv.url, srv.model, srv.max_model_len, srv.lines)


# -- client --------------------------------------------------------------------------------------
async def one_request(client: Any, req: Req, salt: str | None, model: str,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if salt is not None:  # None: no cache_salt key at all (vllm-router's kv_aware credits no salted request)
        body["cache_salt"] = salt
    body.update(extra or {})
    first = last = None
    usage: dict[str, Any] = {}
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"request {req.index}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"request {req.index}: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and (chunk["choices"][0].get("text") or chunk["choices"][0].get("finish_reason")):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    if first is None or last is None or not usage:
        raise RuntimeError(f"request {req.index}: the stream ended without tokens or usage")
    out = usage["completion_tokens"]
    if out != req.max_tokens:  # ignore_eos: anything else means the request was cut short
        raise RuntimeError(f"request {req.index}: {out} output tokens, {req.max_tokens} requested")
    return {"index": req.index, "prompt_tokens": usage["prompt_tokens"], "output_tokens": out,
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "ttft_s": first - sent, "tpot_s": (last - first) / (out - 1) if out > 1 else None,
            "latency_s": last - sent}


async def replay(url: str, reqs: list[Req], concurrency: int, salt: str | None, model: str, timeout: float,
                 extras: dict[int, dict[str, Any]] | None = None,
                 after: dict[int, int] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Sends `reqs` in order, at most `concurrency` in flight; returns per-request results (in the
    order of `reqs`) and wall time. `extras`: more body fields per request index. `after`: request
    index -> the index of an earlier request that must have finished before it is sent (a
    conversation's next turn waits for the answer to its last one; later requests wait behind it)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def guarded(r: Req) -> dict[str, Any]:
            try:
                return await one_request(client, r, salt, model, (extras or {}).get(r.index))
            finally:
                sem.release()

        tasks = []
        by_index: dict[int, asyncio.Task[dict[str, Any]]] = {}
        start = time.perf_counter()
        for r in reqs:
            dep = (after or {}).get(r.index)
            prev = by_index.get(dep) if dep is not None else None
            if prev is not None:
                await asyncio.wait([prev])  # its failure, if any, is raised by gather below
            await sem.acquire()
            task = asyncio.create_task(guarded(r))
            tasks.append(task)
            by_index[r.index] = task
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def kv_stats(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(url + "/v1/kv/stats", timeout=60).raise_for_status().json()


def hit_tokens(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Prompt tokens each tier served over the run."""
    out = {"G1": after["tiers"]["G1"]["prefix_cache_hits"] - before["tiers"]["G1"]["prefix_cache_hits"]}
    for tier, st in after["tiers"].items():
        if tier != "G1":  # G2, G3 and whatever else the server lists (G4 with --server-arg)
            out[tier] = st["hit_tokens"] - before["tiers"][tier]["hit_tokens"]
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--trace", type=Path, default=TRACE, help="Mooncake-format JSONL trace (default %(default)s)")
    ap.add_argument("--start", type=int, default=-64,
                    help="first trace request of the slice; negative counts from the end (default %(default)s)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests in the slice (default %(default)s)")
    ap.add_argument("--scale", type=float, default=1 / 32,
                    help="token scale: a 512-token trace block becomes round(512 * SCALE) tokens "
                         "(default 1/32: 16-token blocks, the longest default prompt 2.1k tokens)")
    ap.add_argument("--output-scale", type=float, default=0.1,
                    help="output tokens = round(output_length * OUTPUT_SCALE), clamped (default %(default)s)")
    ap.add_argument("--min-output", type=int, default=4, help="fewest output tokens per request (default %(default)s)")
    ap.add_argument("--max-output", type=int, default=12, help="most output tokens per request (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight at most (default %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode, interleaved; medians reported (default 3)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="G1 size in blocks, both modes (default: --concurrency of the longest requests, +25%%)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per G1 block, both modes (default %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="token budget of one engine step, both modes; long prefills are chunked to it, "
                         "which bounds how long running decodes stall behind a prefill (default %(default)s)")
    ap.add_argument("--g2-gib", type=float, default=None,
                    help="G2 size in GiB for mode on (default: the slice's distinct blocks, +25%%, at least 0.25)")
    ap.add_argument("--g3", action="store_true", help="mode on also gets a G3 disk tier (a temporary directory)")
    ap.add_argument("--g3-gib", type=float, default=4.0, help="G3 size in GiB with --g3 (default %(default)s)")
    ap.add_argument("--g3-dir", type=Path, default=None,
                    help="parent directory of the G3 tier's temporary directory (default: the system's temp dir)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                    help="weight and KV dtype of both servers (default %(default)s)")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="OMP_NUM_THREADS of the servers (default: all usable cores)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the block token ids (default %(default)s)")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds per request (default %(default)s)")
    ap.add_argument("--start-timeout", type=float, default=300,
                    help="seconds for a server to start (default %(default)s)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for both servers (repeatable, e.g. --server-arg=--kv-offload-block-size=64)")
    ap.add_argument("--dry-run", action="store_true", help="print the workload and the server flags, start nothing")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "serve.json", help="JSON results (default %(default)s)")
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        ap.error(f"no trace at {args.trace} (give --trace)")
    if args.runs < 1 or args.num_requests < 1 or args.concurrency < 1 or args.scale <= 0:
        ap.error("--runs, --num-requests and --concurrency must be >= 1 and --scale > 0")
    if not 2 <= args.min_output <= args.max_output:
        ap.error("need 2 <= --min-output <= --max-output (TPOT needs two tokens)")

    if args.model:
        model_dir = Path(args.model)
    else:
        from engine.demo.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dtype_bytes = 2 if args.dtype in ("bfloat16", "float16") else 4
    kv_bytes_per_token = cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes

    wl = build_workload(load_trace(args.trace, args.start, args.num_requests), args.scale, args.output_scale,
                        args.min_output, args.max_output, vocab, args.seed)
    summary = wl.summary()
    longest = max(len(r.prompt) + r.max_tokens for r in wl.reqs)
    g1_blocks = args.num_gpu_blocks or math.ceil(1.25 * args.concurrency * longest / args.block_size)
    g2_gib = args.g2_gib if args.g2_gib is not None else max(0.25, math.ceil(
        1.25 * wl.distinct_tokens * kv_bytes_per_token / 2**30 * 4) / 4)
    log(f"workload: {summary['requests']} requests (trace lines {summary['trace_lines'][0]}-"
        f"{summary['trace_lines'][1]}), {summary['prompt_tokens']:,} prompt tokens ({summary['distinct_tokens']:,} "
        f"distinct), longest {summary['longest_prompt']:,}; {summary['requests_reusing_a_prefix']} reuse a prefix, "
        f"{summary['reusable_token_fraction']:.0%} of prompt tokens reusable with an unbounded cache; "
        f"G1 {g1_blocks} blocks ({g1_blocks * args.block_size:,} tokens), G2 {g2_gib:g} GiB")

    common = ["--dtype", args.dtype, "--block-size", str(args.block_size), "--num-gpu-blocks", str(g1_blocks),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level", "warning",
              *args.server_arg]
    if args.model:
        common.insert(0, str(model_dir))
    on_args = [*common, "--kv-offloading-size", f"{g2_gib:g}"]
    g3_tmp = tempfile.TemporaryDirectory(prefix="kvtier-serve-bench-g3-", dir=args.g3_dir) if args.g3 else None
    if g3_tmp is not None:  # removed at the end; entries are namespaced by cache_salt per run meanwhile
        on_args += ["--kv-offload-disk", g3_tmp.name, "--kv-offload-disk-size", f"{args.g3_gib:g}"]
    mode_args = {"off": common, "on": on_args}
    if args.dry_run:
        if g3_tmp is not None:
            g3_tmp.cleanup()
        print(json.dumps({"workload": summary, "server_args": mode_args,
                          "prompt_lengths": [len(r.prompt) for r in wl.reqs],
                          "reused_tokens": [r.reused_tokens for r in wl.reqs],
                          "max_tokens": [r.max_tokens for r in wl.reqs]}))
        return 0
    warmup = [Req(-1, [MIN_TOKEN_ID + (i % 1000) for i in range(min(args.max_num_batched_tokens, 512))], 4, 0),
              Req(-2, [MIN_TOKEN_ID + 7] * 32, 4, 0)]

    def measure(mode: str, run: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        srv = start_server(mode_args[mode], args.threads, args.start_timeout)
        started = time.perf_counter() - t0
        try:
            if longest > srv.max_model_len:
                raise RuntimeError(f"the longest request needs {longest} tokens but the server's max_model_len is "
                                   f"{srv.max_model_len}; raise --num-gpu-blocks or lower --scale")
            asyncio.run(replay(srv.url, warmup, 1, f"warmup-{uuid.uuid4().hex}", srv.model, args.request_timeout))
            before = kv_stats(srv.url)
            results, wall = asyncio.run(replay(srv.url, wl.reqs, args.concurrency, f"run{run}-{uuid.uuid4().hex}",
                                               srv.model, args.request_timeout))
            after = kv_stats(srv.url)
        except BaseException:
            log(f"[{mode} run {run + 1}] failed; the server's last lines:\n{srv.tail()}")
            raise
        finally:
            srv.stop()
        ttft = [r["ttft_s"] for r in results]
        tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
        return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
                "req_per_s": len(results) / wall, "wall_s": wall, "server_start_s": started,
                "hit_tokens": hit_tokens(before, after),
                "g1_evictions": after["tiers"]["G1"]["evictions"] - before["tiers"]["G1"]["evictions"],
                "preemptions": after["requests"]["preemptions"] - before["requests"]["preemptions"],
                "requests": results}

    def progress(run: int, mode: str, m: dict[str, Any]) -> None:
        hits = ", ".join(f"{t} {n:,}" for t, n in m["hit_tokens"].items())
        log(f"[{mode} run {run + 1}/{args.runs}] TTFT p50 {m['ttft_p50_s']:.3f}s p99 {m['ttft_p99_s']:.2f}s, "
            f"TPOT p50 {m['tpot_p50_s'] * 1e3:.0f}ms, {m['req_per_s']:.3f} req/s in {m['wall_s']:.0f}s "
            f"(server start {m['server_start_s']:.0f}s); "
            f"hit tokens {hits}")

    t_start = time.perf_counter()
    try:
        runs = run_interleaved(args.runs, {"off": lambda r: measure("off", r), "on": lambda r: measure("on", r)},
                               progress)
    finally:
        if g3_tmp is not None:
            g3_tmp.cleanup()

    keys = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "req_per_s", "wall_s")
    med: dict[str, dict[str, float]] = {}
    for mode, ms in runs.items():
        med[mode] = {k: median([m[k] for m in ms]) for k in keys}
        for tier in ("G1", "G2", "G3"):
            med[mode][f"{tier}_hit_tokens"] = median([m["hit_tokens"].get(tier, 0) for m in ms])
    rows = []
    for mode in ("off", "on"):
        m = med[mode]
        tiers = "G1" if mode == "off" else "G1+G2" + ("+G3" if args.g3 else "")
        rows.append([mode, tiers, f"{m['ttft_p50_s']:.3f}", f"{m['ttft_p99_s']:.2f}", f"{m['tpot_p50_s'] * 1e3:.0f}",
                     f"{m['tpot_p99_s'] * 1e3:.0f}", f"{m['req_per_s']:.3f}",
                     *(f"{int(m[f'{t}_hit_tokens']):,}" for t in ("G1", "G2", "G3"))])
    print_table(["mode", "tiers", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms", "req/s",
                 "G1 hit tok", "G2 hit tok", "G3 hit tok"], rows)
    got = ratio(med["off"]["ttft_p50_s"], med["on"]["ttft_p50_s"])
    per_run = [ratio(a["ttft_p50_s"], b["ttft_p50_s"]) for a, b in zip(runs["off"], runs["on"])]
    print(f"workload: {summary['requests']} requests, {summary['prompt_tokens']:,} prompt tokens "
          f"(longest {summary['longest_prompt']:,}), {summary['requests_reusing_a_prefix']} reuse an earlier prefix; "
          f"G1 {g1_blocks * args.block_size:,} tokens, concurrency {args.concurrency}; medians of {args.runs} run(s)")
    print(f"p50 TTFT off/on: {got:.1f}x (per run: {', '.join(f'{x:.1f}x' for x in per_run)}); "
          f"throughput on/off: {ratio(med['on']['req_per_s'], med['off']['req_per_s']):.2f}x")
    met = bool(got and got >= TARGET_RATIO)
    print(f"target: offload cuts p50 TTFT by >= {TARGET_RATIO:.0f}x: {'met' if met else 'NOT met'}")

    path = write_json(args.out, {
        "benchmark": "serve",
        "workload": {**summary, "trace": str(args.trace), "start": args.start, "scale": args.scale,
                     "output_scale": args.output_scale, "min_output": args.min_output, "max_output": args.max_output,
                     "concurrency": args.concurrency, "seed": args.seed},
        "server_args": mode_args, "g1_blocks": g1_blocks, "g2_gib": g2_gib, "threads": args.threads,
        "kv_bytes_per_token": kv_bytes_per_token, "runs": runs, "median": med,
        "ttft_p50_ratio_off_on": got, "ttft_p50_ratio_per_run": per_run, "target_ratio": TARGET_RATIO,
        "target_met": met})
    log(f"wrote {path} ({time.perf_counter() - t_start:.0f} s in all)")
    plot_file(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

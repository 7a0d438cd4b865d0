"""A fault campaign you can rerun: one `kvtier serve` with G2, G3 and G4 (a redis-server this
script starts) replays a Mooncake trace slice for --minutes while a chaos thread injects faults,
and every request's greedy output is compared, token for token, with the output of the same
request on a clean server (no offload, no prefix caching: every token recomputed).

Workload: benchmarks/serve.py's (its functions are imported, not copied): the trace slice
(--start, --num-requests) scaled by --scale, token ids per hash id, prompts sent as token ids to
/v1/completions with temperature 0, ignore_eos and return_token_ids; max_tokens from the trace's
output_length * --output-scale, clamped to [--min-output, --max-output]. The slice is replayed
over and over, in trace order, --concurrency requests in flight (closed loop). Pass p uses the
cache_salt of tenant p % --tenants, so a tenant's second pass finds its prefixes in whichever
tier kept them. The sizes make every tier matter: by default (--scale 1/64) one tenant's distinct
blocks take 364 MiB of float32 KV; G1 holds two of the longest requests, G2 (0.25 GiB) about 70%
of one tenant, G3 (0.5 GiB) about 70% of both, Redis (2 GiB) all of them.

Oracle: each distinct request of the slice once, on a clean `kvtier serve` with the same G1
flags plus --no-enable-prefix-caching and no offload, with the top-2 logprobs of every output
token (their margin tells a near tie from damage when an output differs). Cached in
benchmarks/results/soak-oracle-<key>.json, the key covering the workload, the flags, the model
files and the source of engine/, server/, kvstore/, connectors/ and policies/. Computing it takes
1.5-4.5 minutes on 2 cores, before the --minutes of chaos.

Faults, one at a time, --fault-interval seconds apart on average (exponential; the kinds come
in shuffled rounds so that each kind occurs once before any occurs twice):
  core_kill   SIGKILL the engine core (the server process's child running multiprocessing's
              spawn_main); the server is expected to exit with code 1 (else, after
              --exit-timeout s, it is killed and that is recorded as a finding); it is restarted
              with the same G3 directory and Redis. Recovery = kill -> first successful response.
  redis_stop  SIGSTOP Redis for --redis-stop-s, then SIGCONT.
  redis_kill  SIGKILL Redis, --redis-down-s later a new one on the same port (empty).
  g3_readonly the G3 directory read-only for --g3-fault-s: a read-only bind mount over it
              (EROFS, even for root); without mount rights: chmod 0500 (non-root) or chattr +i
              (root); otherwise skipped, and the JSON says which.
  g3_full     the G3 filesystem full for --g3-fault-s: G3 lives on a tmpfs this script mounts
              (--g3-gib + 128 MiB) and a filler file takes all its free space (ENOSPC); without a
              tmpfs, RLIMIT_FSIZE 0 on the engine core (prlimit; writes fail with EFBIG).
  g3_flip     one random byte XOR a random non-zero value in each of --flip-files random G3
              .kvb files (header or payload, wherever the offset falls).
  g3_stranger a FIFO, a symlink and a directory in place of three live G3 entries (issue 38):
              misses, removed; recovery = a G3 hit or write after them.
  hostile     one of issue 38's hostile requests (benchmarks/_hostile.py, in turn: 50,000
              bad_words, a 60,000-entry choice, ...) beside the workload: an answer or a 400,
              and its time; the workload's outputs are checked as always.
For Redis and G3 faults, recovery = fault cleared -> the tier works again (G4: breaker closed and
a G4 hit or write; G3: a G3 write), polled every second for at most --recovery-timeout s.

Counting: a request fails (by cause: connection refused/dropped, timeout, HTTP status, finish
reason) or completes; a completed request whose tokens differ from the oracle's is wrong.
Retry policy: none. Corrupt entries detected = the corrupt counters of G2, G3 and G4 in
/v1/kv/stats, summed over server restarts. Corrupt entries served = wrong outputs of requests
that had lower-tier hits: a request "had" them if it reported cached tokens and the G2+G3+G4
hit counters rose between /v1/kv/stats taken just before it was sent and just after it ended
(with concurrency > 1 this over-attributes, which only makes the count stricter). Hit rate per
tier: /v1/kv/stats every --sample-interval s (and around every request), per-minute deltas of
each tier's hit tokens over the prompt tokens. A failed request is charged to the fault whose
window (start -> recovered or cleared, + 5 s) it overlaps; failures outside every window, a server
that does not exit after its core died, an exit code other than 1, a failed restart, and corrupt
entries found before any byte was flipped (beyond the temp files of writes a killed core left,
which G3 counts as corrupt too; the server log tells them apart) are reported as findings.

Prints three tables (summary, faults, per minute), writes them with every request, fault and
sample to --out, and the servers' logs beside it (.log). Exit code 1 when any output is wrong
or any corrupt entry was served (or the run was interrupted, or no server could be restarted).
Needs root (or mount rights) for the bind mount and the tmpfs; falls back as described otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))
sys.path.append(str(_HERE.parent / "tests" / "remote"))  # redis_procs: the G4 tests' redis-server helper

from _chaos import FAULT_KINDS, try_mount_tmpfs, unmount  # noqa: E402
from _common import RESULTS_DIR, log, usable_cpus, write_json  # noqa: E402
from _soak_oracle import get_oracle, oracle_key  # noqa: E402
from _soak_report import report  # noqa: E402
from _soak_run import Soak  # noqa: E402
from redis_procs import SERVER as REDIS_SERVER  # noqa: E402
from redis_procs import RedisProc, free_port  # noqa: E402
from serve import TRACE, build_workload, load_trace  # noqa: E402


# -- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the chaos phase (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the fault schedule, the files flipped and the block token ids (default %(default)s)")
    ap.add_argument("--fault-interval", type=float, default=30.0,
                    help="mean seconds between one fault's end and the next fault (exponential; default %(default)s)")
    ap.add_argument("--first-fault", type=float, default=20.0,
                    help="seconds before the first fault can come, added to the random interval (default %(default)s)")
    ap.add_argument("--faults", default=",".join(FAULT_KINDS),
                    help="comma-separated fault kinds to inject (default: all: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json",
                    help="JSON results (default %(default)s); the servers' logs go beside it (.log)")
    ap.add_argument("--trace", type=Path, default=TRACE, help="Mooncake-format JSONL trace (default %(default)s)")
    ap.add_argument("--start", type=int, default=-64,
                    help="first trace request of the slice; negative counts from the end (default %(default)s)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests in the slice (default %(default)s)")
    ap.add_argument("--scale", type=float, default=1 / 64,
                    help="token scale of the trace, as in serve.py (default 1/64: 8-token trace blocks, the longest "
                         "prompt 1k tokens, 25k prompt tokens per pass over the default slice)")
    ap.add_argument("--output-scale", type=float, default=0.1,
                    help="max_tokens = round(output_length * OUTPUT_SCALE), clamped (default %(default)s)")
    ap.add_argument("--min-output", type=int, default=8, help="fewest output tokens per request (default %(default)s)")
    ap.add_argument("--max-output", type=int, default=16, help="most output tokens per request (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (default %(default)s)")
    ap.add_argument("--tenants", type=int, default=2,
                    help="cache_salts used in turn, one per pass over the slice (default %(default)s)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per G1 block (default %(default)s)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="G1 blocks (default: --concurrency of the longest requests, +25%%, as serve.py)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="step token budget (default %(default)s)")
    ap.add_argument("--g2-gib", type=float, default=0.25, help="G2 size in GiB (default %(default)s)")
    ap.add_argument("--g3-gib", type=float, default=0.5, help="G3 size in GiB (default %(default)s)")
    ap.add_argument("--redis-mib", type=int, default=2048, help="Redis maxmemory in MiB (default %(default)s)")
    ap.add_argument("--g3-dir", type=Path, default=None,
                    help="parent of the G3 directory (default: the system's temp dir)")
    ap.add_argument("--no-tmpfs", action="store_true",
                    help="keep G3 on the parent's filesystem instead of a tmpfs mounted for it; g3_full then "
                         "uses RLIMIT_FSIZE on the engine core")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype of both servers (default %(default)s)")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="OMP_NUM_THREADS of the servers (default: all usable cores)")
    ap.add_argument("--exit-timeout", type=float, default=10.0,
                    help="seconds the server may take to exit after its core is killed (default %(default)s)")
    ap.add_argument("--redis-stop-s", type=float, default=5.0, help="SIGSTOP length (default %(default)s)")
    ap.add_argument("--redis-down-s", type=float, default=5.0,
                    help="seconds between killing Redis and its restart (default %(default)s)")
    ap.add_argument("--g3-fault-s", type=float, default=15.0,
                    help="seconds G3 stays read-only or full (default %(default)s)")
    ap.add_argument("--flip-files", type=int, default=8, help="G3 files damaged per g3_flip (default %(default)s)")
    ap.add_argument("--recovery-timeout", type=float, default=45.0,
                    help="most seconds to wait for a tier to work again after a fault (default %(default)s)")
    ap.add_argument("--sample-interval", type=float, default=5.0,
                    help="seconds between /v1/kv/stats samples (default %(default)s)")
    ap.add_argument("--progress-interval", type=float, default=30.0,
                    help="seconds between progress lines (default %(default)s)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (default %(default)s)")
    ap.add_argument("--start-timeout", type=float, default=300.0,
                    help="seconds for a server to start (default %(default)s)")
    ap.add_argument("--no-oracle-cache", action="store_true", help="recompute the oracle even if it is cached")
    ap.add_argument("--dry-run", action="store_true", help="print the workload and the server flags, start nothing")
    args = ap.parse_args(argv)
    args.faults = [k.strip() for k in args.faults.split(",") if k.strip()]
    if bad := [k for k in args.faults if k not in FAULT_KINDS]:
        ap.error(f"unknown fault kind(s) {bad}; choose from {', '.join(FAULT_KINDS)}")
    if not args.trace.is_file():
        ap.error(f"no trace at {args.trace} (give --trace)")
    if REDIS_SERVER is None:
        ap.error("no redis-server or valkey-server on PATH (G4 needs one)")
    if args.minutes <= 0 or args.concurrency < 1 or args.tenants < 1 or args.fault_interval <= 0:
        ap.error("--minutes and --fault-interval must be > 0, --concurrency and --tenants >= 1")
    if not 1 <= args.min_output <= args.max_output:
        ap.error("need 1 <= --min-output <= --max-output")

    from engine.demo.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    cfg = json.loads((model_dir / "config.json").read_text())
    wl = build_workload(load_trace(args.trace, args.start, args.num_requests), args.scale, args.output_scale,
                        args.min_output, args.max_output, cfg["vocab_size"], args.seed)
    summary = wl.summary()
    longest = max(len(r.prompt) + r.max_tokens for r in wl.reqs)
    g1_blocks = args.num_gpu_blocks or math.ceil(1.25 * args.concurrency * longest / args.block_size)
    common = ["--dtype", args.dtype, "--block-size", str(args.block_size), "--num-gpu-blocks", str(g1_blocks),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level", "warning"]
    oracle_args = [*common, "--no-enable-prefix-caching"]
    log(f"workload: {summary['requests']} requests (trace lines {summary['trace_lines'][0]}-"
        f"{summary['trace_lines'][1]}), {summary['prompt_tokens']:,} prompt tokens ({summary['distinct_tokens']:,} "
        f"distinct), longest {summary['longest_prompt']:,}, {summary['output_tokens']} output tokens; "
        f"G1 {g1_blocks} blocks, G2 {args.g2_gib:g} GiB, G3 {args.g3_gib:g} GiB, Redis {args.redis_mib} MiB")
    if args.dry_run:
        print(json.dumps({"workload": summary, "oracle_args": oracle_args, "soak_args": common}))
        return 0

    def on_term(*_: Any) -> None:  # SIGTERM cleans up like Ctrl-C: servers stopped, mounts undone
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    key = oracle_key(summary["sha256"], oracle_args, args.concurrency, model_dir)
    oracle, oracle_info = get_oracle(args, wl.reqs, oracle_args, key)

    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-", dir=args.g3_dir))
    g3_root = work / "g3"
    g3_root.mkdir()
    g3_tmpfs = False
    tmpfs_why = "--no-tmpfs"
    if not args.no_tmpfs:
        why = try_mount_tmpfs(g3_root, int(args.g3_gib * 1024) + 128)
        g3_tmpfs, tmpfs_why = why is None, why or f"tmpfs of {int(args.g3_gib * 1024) + 128} MiB"
    log(f"G3 at {g3_root}: {'tmpfs' if g3_tmpfs else 'the parent filesystem'} ({tmpfs_why}); "
        f"running as uid {os.geteuid()}")
    redis = RedisProc(work / "redis", free_port(), ("--maxmemory", f"{args.redis_mib}mb"))
    soak_args = [*common, "--kv-offloading-size", f"{args.g2_gib:g}", "--kv-offload-disk", str(g3_root),
                 "--kv-offload-disk-size", f"{args.g3_gib:g}", "--kv-offload-remote", redis.url,
                 "--kv-offload-remote-trusted"]
    soak: Soak | None = None
    interrupted = False
    try:
        redis.start()
        soak = Soak(args, soak_args, wl.reqs, oracle, g3_root, g3_tmpfs, redis)
        try:
            soak.run()
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: reporting what ran")
        duration = soak.now()
    finally:
        if soak is not None:
            soak.close()
        redis.stop()
        if g3_tmpfs:
            unmount(g3_root)
        shutil.rmtree(work, ignore_errors=True)

    doc, table = report(soak, duration)
    print(table, flush=True)
    log_path = args.out.with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("".join(f"===== server #{inc} =====\n" + "".join(lines) for inc, lines in soak.logs))
    path = write_json(args.out, {
        **doc, "interrupted": interrupted, "table": table, "server_log": str(log_path),
        "workload": {**summary, "trace": str(args.trace), "start": args.start, "scale": args.scale,
                     "output_scale": args.output_scale, "min_output": args.min_output,
                     "max_output": args.max_output, "concurrency": args.concurrency, "tenants": args.tenants},
        "config": {"soak_server_args": soak_args, "oracle_server_args": oracle_args, "threads": args.threads,
                   "g3": "tmpfs" if g3_tmpfs else "parent filesystem", "g3_tmpfs_note": tmpfs_why,
                   "uid": os.geteuid(), "redis": REDIS_SERVER, "redis_maxmemory_mib": args.redis_mib,
                   **{k: getattr(args, k) for k in ("minutes", "seed", "fault_interval", "first_fault", "faults",
                                                    "exit_timeout", "redis_stop_s", "redis_down_s", "g3_fault_s",
                                                    "flip_files", "recovery_timeout", "sample_interval")}},
        "oracle": {**oracle_info, "requests": len(oracle)}})
    log(f"wrote {path} and {log_path}")
    s = doc["summary"]
    return 1 if s["wrong_outputs"] or s["corrupt_entries_served"] or interrupted or soak.fatal else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before the chaos phase (the oracle): nothing to report
        log("interrupted")
        sys.exit(130)

"""How much does a lower-tier hit save? TTFT cold vs G1, G2 and G3 hits, and load bandwidth.

For each prompt length, one run measures five ways (interleaved over --runs, medians reported):
  cold   the prompt is new: full prefill (fresh cache_salt, so no tier can hit)
  G1     the same prompt again right away: a G1 prefix-cache hit
  G2     G1 emptied (prefix cache reset), the prompt's blocks in host memory (G2)
  G3     G1 emptied, no G2, the blocks on disk (G3). The OS page cache is dropped first when
         /proc/sys/vm/drop_caches is writable (recorded in the JSON); otherwise reads may be
         served from the page cache, and the JSON says so.
  G3-tmpfs  the same with G3 on a tmpfs (--tmpfs-dir, /dev/shm): a stand-in for a fast NVMe
         array, where per-entry work rather than the medium decides.
  G4     G1 emptied, no G2 or G3, the blocks in a Redis/Valkey (a redis-server this script
         starts on a free loopback port, or --redis-url). Skipped when neither exists.
TTFT is the wall time of generate(max_tokens=1). A hit still recomputes the prompt's tail that
does not fill a whole offload block (at most --offload-block-size - 1 tokens, plus the last token).

Bandwidth: the bytes a hit placed into G1 divided by the load's time on the transfer thread,
next to a raw torch copy of the same bytes, a raw parallel read of the same G3 files from the same
medium (read_threads threads, whole files, page cache dropped for the disk; on the tmpfs, whose
pages stay, each run also reads a fresh copy of its own files right after its load, so that both
are first reads: the target is the median of those per-run ratios), and
`redis-benchmark`'s own GET throughput at the offload block's value size (for G4). For G3 the load
is split into read (preadv, summed over reader threads), check (checksums) and copy (into G1).

Bytes per hit: what a hit placed into G1, against the whole history of every layer for the same
tokens. They differ on a model with sliding-window layers (Gemma 3/4: `--model` a Gemma
checkpoint), whose KV groups load the full layers' history but the sliding layers' last window.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import (RESULTS_DIR, Timer, log, median, preload_allocator, print_table, ratio,  # noqa: E402
                     set_torch_threads, usable_cpus, write_json)
from _plots import plot_file  # noqa: E402

TARGETS = {"G2": 100.0, "G3": 60.0, "G4": 45.0}  # speedup over cold at the longest length (issues 3, 6, 43)
RAW_TARGETS = {"G3": 0.9, "G3-tmpfs": 0.7}  # load bandwidth / raw parallel read of the same files (issue 43)
DISK_TIERS = ("G3", "G3-tmpfs")


class LocalRedis:
    """A throwaway redis-server on a free loopback port (no persistence)."""

    def __init__(self, workdir: Path) -> None:
        import shutil
        import socket
        import subprocess
        import time

        self.server = shutil.which("valkey-server") or shutil.which("redis-server")
        self.bench = shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")
        self.proc = None
        if self.server is None:
            return
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([self.server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir), "--maxmemory-policy",
                                      "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str | None:
        return f"redis://127.0.0.1:{self.port}" if self.proc is not None else None

    def bench_GBps(self, value_bytes: int) -> dict[str, float]:
        """redis-benchmark's SET and GET throughput at this value size, in GB/s of values (its SET
        run stores the value the GETs read); empty without redis-benchmark."""
        import subprocess

        if self.bench is None:
            return {}
        n = max(200, min(5000, int(2e9 // value_bytes)))
        cmd = [self.bench, "-p", str(self.port), "-t", "set,get", "-d", str(value_bytes), "-n", str(n),
               "-c", "4", "-P", "8", "--csv", "-q"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        rates = {}
        for line in out.splitlines():
            cells = [c.strip('"') for c in line.split(",")]
            if cells and cells[0].upper() in ("SET", "GET"):
                rates[cells[0].upper()] = float(cells[1]) * value_bytes / 1e9
        return rates

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def ttft(llm, prompt: list[int], salt: str) -> tuple[float, Any]:
    from engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with Timer() as t:
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False, cache_salt=salt)[0]
    return t.seconds, out


def raw_copy_GBps(nbytes: int) -> float:
    """A torch copy of `nbytes` in memory."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    dst.copy_(src)
    with Timer() as t:
        dst.copy_(src)
    return nbytes / t.seconds / 1e9


def first_read_GBps(files: list[Path], threads: int, scratch: Path) -> float:
    """`threads` at once, whole-file reads of a fresh copy of `files` (under `scratch`, on their
    filesystem), each read for the first time, as a load reads the G3 files just written: on Linux
    a page's first read after it was written costs more (it moves to the active list; 5.1 against
    6.9 GB/s for a second read on a Zen 1 VM), and a tmpfs never drops its pages. The copy is
    removed."""
    from concurrent.futures import ThreadPoolExecutor

    size = max((f.stat().st_size for f in files), default=1)
    with tempfile.TemporaryDirectory(prefix="raw-first-", dir=scratch) as copy_dir:
        copies = [Path(copy_dir) / f"{i}.kvb" for i in range(len(files))]
        for f, c in zip(files, copies):
            shutil.copyfile(f, c)

        def read(f: Path) -> int:
            with open(f, "rb", buffering=0) as fh:
                return fh.readinto(bytearray(size))

        with Timer() as r, ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(read, copies))
    return total / max(r.seconds, 1e-9) / 1e9


def raw_read_GBps(g3_dir: Path, threads: int, drop: bool) -> dict[str, float | bool]:
    """Whole-file reads of every G3 file under `g3_dir`, one at a time and `threads` at once (as
    the load path reads), the page cache dropped first when `drop` and possible. And `threads`
    at once into place: each file into its own slice of one buffer that holds them all (touched
    beforehand, as G1 is), where the others read into one reused buffer or a file-sized one per
    file, which the allocator recycles (cache-warm). A load must place every byte in distinct
    memory, so this is the bound for a load straight into G1."""
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(g3_dir.rglob("*.kvb"))
    size = max((f.stat().st_size for f in files), default=1)

    def read(f: Path, buf: bytearray | memoryview | None = None) -> int:
        with open(f, "rb", buffering=0) as fh:
            return fh.readinto(buf if buf is not None else bytearray(size))

    out: dict[str, float | bool] = {"files": len(files)}
    for label, n in (("file_read_GBps", 1), ("file_read_parallel_GBps", threads)):
        out["page_cache_dropped"] = drop and drop_page_cache()
        buf = bytearray(size)
        with Timer() as r:
            if n == 1:
                total = sum(read(f, buf) for f in files)
            else:
                with ThreadPoolExecutor(n) as ex:
                    total = sum(ex.map(read, files))
        out[label] = total / max(r.seconds, 1e-9) / 1e9
    sizes = [f.stat().st_size for f in files]
    whole = memoryview(bytearray(sum(sizes)))  # zero-filled: touched
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    out["page_cache_dropped"] = drop and drop_page_cache()
    with Timer() as r:
        with ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(lambda i: read(files[i], whole[starts[i]:starts[i] + sizes[i]]), range(len(files))))
    out["file_read_placed_GBps"] = total / max(r.seconds, 1e-9) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--lengths", default="1000,4000,8000", help="prompt lengths in tokens (default %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs per length and mode; medians reported (default 3)")
    ap.add_argument("--offload-block-size", type=int, default=16,
                    help="tokens per offload block (default 16, the engine's default: G1's block size)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: all cores)")
    ap.add_argument("--redis-url", default=None,
                    help="G4 server (redis://host:port); default: start a redis-server on a free loopback "
                         "port, or skip the G4 mode when none is installed")
    ap.add_argument("--tiers", default="G2,G3,G3-tmpfs,G4",
                    help="lower tiers to measure, of G2, G3, G3-tmpfs, G4 (default %(default)s)")
    ap.add_argument("--tmpfs-dir", type=Path, default=Path("/dev/shm"),
                    help="a tmpfs for the G3-tmpfs mode (default %(default)s)")
    ap.add_argument("--g3-io-mib", type=float, default=None,
                    help="G3 file and read size in MiB (kv_connector_extra_config g3_io_mib; default: the engine's)")
    ap.add_argument("--g3-read-threads", type=int, default=None,
                    help="G3 reader threads (kv_connector_extra_config g3_read_threads; default: the engine's)")
    ap.add_argument("--no-cold", action="store_true",
                    help="skip the cold and G1 modes, one prefill per run less: for load-bandwidth runs only "
                    "(no speedups over cold are reported)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "offload.json", help="JSON results (default %(default)s)")
    args = ap.parse_args(argv)
    wanted = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if not set(wanted) <= {"G2", "G3", "G3-tmpfs", "G4"}:
        ap.error(f"--tiers: unknown {sorted(set(wanted) - {'G2', 'G3', 'G3-tmpfs', 'G4'})}")
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.runs < 1 or any(n < 2 for n in lengths):
        ap.error("--runs must be >= 1 and lengths >= 2")
    set_torch_threads(args.threads)
    import random

    from engine import LLM
    from engine.demo.demo_model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    rng = random.Random(0)
    max_len = max(lengths) + 8
    common = dict(dtype="float32", max_model_len=max_len, kv_offload_block_size=args.offload_block_size,
                  max_num_batched_tokens=2048)
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-offload-bench-")  # G3 files are removed at the end
    work = Path(tmp.name)
    shm = tempfile.TemporaryDirectory(prefix="kvtier-offload-bench-", dir=args.tmpfs_dir) if "G3-tmpfs" in wanted else None
    g3_dirs = {**({"G3": work / "g3"} if "G3" in wanted else {}), **({"G3-tmpfs": Path(shm.name) / "g3"} if shm else {})}
    g3_cfg = {k: v for k, v in (("g3_io_mib", args.g3_io_mib), ("g3_read_threads", args.g3_read_threads)) if v is not None}
    g3_extra = {"kv_transfer_config": {"kv_connector_extra_config": g3_cfg}} if g3_cfg else {}
    # G1 only (cold + G1 hit); G2 only; G3 only. Sizes hold the longest prompt with room to spare.
    per_token = None
    redis = None if args.redis_url or "G4" not in wanted else LocalRedis(work / "redis")
    g4_url = args.redis_url or (redis.url if redis else None)
    engines = {"G1": LLM(model, **common)}
    if "G2" in wanted:
        engines["G2"] = LLM(model, kv_offloading_size=2.0, **common)
    for tier, where in g3_dirs.items():
        engines[tier] = LLM(model, kv_offload_disk=str(where), kv_offload_disk_size=4.0, **g3_extra, **common)
    if g4_url:
        engines["G4"] = LLM(model, kv_offload_remote=g4_url, kv_offload_remote_trusted=True, **common)
    elif "G4" in wanted:
        log("no redis-server/valkey-server and no --redis-url: the G4 mode is skipped")
    lower = [t for t in ("G2", "G3", "G3-tmpfs", "G4") if t in engines]
    mc = engines["G1"].engine.model_config
    # the whole history of every layer with a cache of its own, per token
    per_token = sum(2 * w for i, w in enumerate(mc.kv_widths) if mc.kv_source(i) == i) * mc.dtype.itemsize
    results: dict[str, Any] = {"lengths": lengths, "offload_block_size": args.offload_block_size, "runs": {},
                               "g3_io_mib": args.g3_io_mib, "g3_read_threads": args.g3_read_threads, "tiers": wanted}
    rows = []
    for n in lengths:
        per_mode: dict[str, list[float]] = {**({} if args.no_cold else {"cold": [], "G1": []}), **{t: [] for t in lower}}
        bw: dict[str, list[float]] = {t: [] for t in lower}
        split: dict[str, list[dict[str, float]]] = {t: [] for t in lower if t in DISK_TIERS}
        first: dict[str, list[float]] = {t: [] for t in lower if t == "G3-tmpfs"}  # raw first reads, per run
        moved: dict[str, int] = {}
        hits: dict[str, int] = {}
        for r in range(args.runs):
            prompt = [rng.randrange(100, mc.vocab_size) for _ in range(n)]
            salt = uuid.uuid4().hex  # a fresh namespace: nothing from earlier runs can hit
            if not args.no_cold:
                t, _ = ttft(engines["G1"], prompt, salt)
                per_mode["cold"].append(t)
                t, out = ttft(engines["G1"], prompt, salt)
                per_mode["G1"].append(t)
                hits["G1"] = out.num_cached_tokens
            for tier in lower:
                llm = engines[tier]
                known = set(g3_dirs[tier].rglob("*.kvb")) if tier == "G3-tmpfs" else set()
                ttft(llm, prompt, salt)  # fills the tier (write-through)
                llm.engine.flush_offload()
                llm.engine.pool.reset_prefix_cache()
                if tier == "G3":
                    results["page_cache_dropped"] = drop_page_cache()
                before = llm.get_stats().tiers
                t, out = ttft(llm, prompt, salt)
                after = llm.get_stats().tiers
                per_mode[tier].append(t)
                hits[tier] = out.cached_tokens_by_tier.get("G3" if tier in DISK_TIERS else tier, 0)
                # The load itself, timed on the transfer thread: bytes placed in G1 per second.
                secs = after["load_seconds"] - before["load_seconds"]
                bw[tier].append((after["load_bytes"] - before["load_bytes"]) / secs / 1e9 if secs else 0.0)
                moved[tier] = after["load_bytes"] - before["load_bytes"]
                if tier in split:
                    split[tier].append({"load_s": secs, **{k: after[src][k] - before[src][k] for src, k in (
                        ("G3", "read_seconds"), ("G3", "check_seconds"))}, "copy_s": after["load_copy_seconds"]
                        - before["load_copy_seconds"]})
                if tier == "G3-tmpfs":  # the same bytes read raw in the load's page state, right after it
                    new = sorted(set(g3_dirs[tier].rglob("*.kvb")) - known)
                    first[tier].append(first_read_GBps(new, llm.engine.connector.tier("G3").read_threads,
                                                      g3_dirs[tier].parent))
            log(f"[{n} tokens, run {r + 1}/{args.runs}] " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in per_mode.items()))
        med = {k: median(v) for k, v in per_mode.items()}
        load_bw = {k: median(v) for k, v in bw.items()}
        results["runs"][str(n)] = {"ttft_s": per_mode, "median_s": med, "hit_tokens": hits,
                                   "load_GBps": bw, "median_load_GBps": load_bw, "loaded_bytes": moved,
                                   "raw_first_read_GBps": first,
                                   # each run's load over the raw first read of its own files, then the median
                                   "load_over_first_read": {t: median([b / f for b, f in zip(bw[t], v)])
                                                            for t, v in first.items()},
                                   "g3_split_s": {t: {k: median([x[k] for x in v]) for k in v[0]} for t, v in split.items()},
                                   "full_history_bytes": {t: hits[t] * per_token for t in lower}}
        vs_cold = ("G1", *lower) if "cold" in med else ()
        rows.append([n] + [f"{med[k]:.3f}" for k in per_mode] + [f"{ratio(med['cold'], med[k]):.1f}x" for k in vs_cold] +
                    [f"{load_bw[t]:.2f}" for t in lower])
    print_table(["tokens", *(f"{k} s" for k in per_mode), *(f"{k} vs cold" for k in vs_cold),
                 *(f"{t} load GB/s" for t in lower)], rows)
    longest = str(max(lengths))
    windows = engines["G1"].engine.kv.windows
    results["kv_groups"] = list(windows)
    r = results["runs"][longest]
    for t in lower:
        full = r["full_history_bytes"][t]
        print(f"{t} hit at {longest} tokens loaded {r['loaded_bytes'][t] / 2**20:.1f} MiB; the whole history of "
              f"every layer is {full / 2**20:.1f} MiB ({r['loaded_bytes'][t] / full:.1%} of it; KV groups "
              f"{windows})" if full else f"{t}: no hit")
    raw: dict[str, Any] = {"torch_copy_GBps": raw_copy_GBps(max(max(r["loaded_bytes"].values(), default=1), 1))}
    results["raw"] = raw
    print(f"raw torch copy {raw['torch_copy_GBps']:.2f} GB/s")
    if "G2" in lower:
        print(f"G2 load {r['median_load_GBps']['G2']:.2f} GB/s: {r['median_load_GBps']['G2'] / raw['torch_copy_GBps']:.0%} "
              f"of a torch copy")
    split_rows = []
    for t in (t for t in lower if t in DISK_TIERS):
        reader = engines[t].engine.connector.tier("G3")
        raw[t] = raw_read_GBps(g3_dirs[t], reader.read_threads, drop=t == "G3")
        bw, par, sp = r["median_load_GBps"][t], raw[t]["file_read_parallel_GBps"], r["g3_split_s"][t]
        # The target's read is in the load's page state: the page cache dropped (disk) or, on a
        # tmpfs, each run's first read of its own files' copy (the ratio per run, then the median)
        same = r["load_over_first_read"].get(t, bw / par)
        split_rows.append([t, f"{sp['load_s']:.3f}", f"{sp['read_seconds']:.3f}", f"{sp['check_seconds']:.3f}",
                           f"{sp['copy_s']:.3f}", f"{bw:.2f}", f"{raw[t]['file_read_GBps']:.2f}", f"{par:.2f}",
                           f"{bw / par:.0%}",
                           f"{median(r['raw_first_read_GBps'][t]):.2f}" if t in r["raw_first_read_GBps"] else "(same)",
                           f"{same:.0%} (target >= {RAW_TARGETS[t]:.0%}: {'met' if same >= RAW_TARGETS[t] else 'NOT met'})",
                           f"{raw[t]['file_read_placed_GBps']:.2f}", f"{bw / raw[t]['file_read_placed_GBps']:.0%}",
                           f"{raw[t]['files']}"])
    if split_rows:
        print(f"G3 loads at {longest} tokens (read and check summed over {reader.read_threads} reader threads; "
              f"files of up to {reader.io_bytes / 2**20:g} MiB):")
        print_table(["tier", "load s", "read s", "check s", "copy s", "load GB/s", "raw read 1 thread GB/s",
                     "raw parallel read GB/s", "load / raw parallel", "raw parallel first read GB/s",
                     "load / raw parallel, same page state", "raw parallel read into place GB/s",
                     "load / into place", "files"], split_rows)
    if "G4" in engines:
        block = engines["G4"].engine.connector.layout.encoded_bytes
        raw["redis_get_GBps"] = redis.bench_GBps(block).get("GET") if redis is not None else None  # our own server only
        g4_bw = results["runs"][longest]["median_load_GBps"]["G4"]
        if raw.get("redis_get_GBps"):
            print(f"redis-benchmark GET at {block / 2**10:.0f} KiB values: {raw['redis_get_GBps']:.2f} GB/s; "
                  f"G4 load {g4_bw:.2f} GB/s ({g4_bw / raw['redis_get_GBps']:.0%} of it)")
    for tier, target in TARGETS.items():
        if tier not in engines or args.no_cold:
            continue
        m = results["runs"][longest]["median_s"]
        got = ratio(m["cold"], m[tier])
        if tier == "G3" and not results.get("page_cache_dropped"):
            print("G3: the page cache could not be dropped; its hits may have been served from memory")
        print(f"{tier} hit at {longest} tokens: {got:.1f}x faster than cold (target >= {target:.0f}x: "
              f"{'met' if got and got >= target else 'NOT met'})")
    for llm in engines.values():
        llm.close()
    if redis is not None:
        redis.close()
    tmp.cleanup()
    if shm is not None:
        shm.cleanup()
    path = write_json(args.out, {"benchmark": "offload", **results})
    log(f"wrote {path}")
    plot_file(path)
    return 0


if __name__ == "__main__":
    preload_allocator()
    sys.exit(main())

"""G4's byte moving alone: how fast do offload-block-sized values go into and come out of Redis?

Four clients of one redis-server (started on a free loopback port, or --redis-url), interleaved
over --runs, each putting then reading --values values of --value-kib KiB in pipelined batches of
--batch (G4's own batch):
  kvtier        kvstore.remote.RedisBackend as G4 uses it: self-checking entries, SETs sent and
                GET replies received in place (kvstore/resp.py)
  kvtier-redispy  the same backend through redis-py's pipelines (its path before resp.py, and its
                fallback): each value joined to its header, each reply a new bytes object, copied
  redis-py      plain redis-py pipelines with no checks: what a client library gives
  redis-benchmark  its SET and GET at the same value size (4 connections, 8 deep): the server's rate
GB/s are of values (payload bytes) per second, medians of the runs.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import RESULTS_DIR, log, median, print_table, run_interleaved, write_json  # noqa: E402

OFFLOAD_BLOCK_KIB = 720  # the demo model's float32 offload block of 16 tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--value-kib", type=int, default=OFFLOAD_BLOCK_KIB, help="value size in KiB (default %(default)s)")
    ap.add_argument("--values", type=int, default=256, help="values written and read per run (default %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="values per pipelined round trip (default %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per client (default %(default)s)")
    ap.add_argument("--redis-url", default=None, help="server (redis://host:port); default: start a redis-server")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "g4_backend.json", help="JSON results (default %(default)s)")
    args = ap.parse_args(argv)
    if min(args.value_kib, args.values, args.batch, args.runs) < 1:
        ap.error("--value-kib, --values, --batch and --runs must be >= 1")
    import redis as redis_py

    from kvstore.remote import RedisBackend, RemoteConfig
    from offload import LocalRedis

    work = tempfile.TemporaryDirectory(prefix="kvtier-g4-bench-")
    server = None if args.redis_url else LocalRedis(Path(work.name) / "redis")
    url = args.redis_url or (server.url if server else None)
    if url is None:
        ap.error("no redis-server/valkey-server installed and no --redis-url")
    size = args.value_kib * 2**10
    values = [os.urandom(size) for _ in range(args.batch)]  # one batch's worth, reused for every batch
    keys = [hashlib.sha256(b"g4-bench-%d" % i).digest()[:16] for i in range(args.values)]
    batches = [keys[i:i + args.batch] for i in range(0, len(keys), args.batch)]
    bufs = [bytearray(size) for _ in range(args.batch)]
    direct = RedisBackend(RemoteConfig(url, bytes(16), timeout_s=30.0))
    fallback = RedisBackend(RemoteConfig(url, bytes(range(16)), timeout_s=30.0), in_place=False)
    plain = redis_py.Redis.from_url(url, socket_timeout=30.0, socket_read_size=2**20)

    def backend_run(b: RedisBackend) -> dict[str, float]:
        t0 = time.perf_counter()
        for ks in batches:
            assert all(b.put(ks, values[:len(ks)])), "a put was refused"
        t1 = time.perf_counter()
        for ks in batches:
            assert all(b.get_into(ks, bufs[:len(ks)])), "a value was missing"
        return {"put": size * len(keys) / (t1 - t0) / 1e9, "get": size * len(keys) / (time.perf_counter() - t1) / 1e9}

    names = [b"g4-bench-plain:" + k.hex().encode() for k in keys]

    def plain_run(_: int) -> dict[str, float]:
        t0 = time.perf_counter()
        for j in range(0, len(names), args.batch):
            p = plain.pipeline(transaction=False)
            for n, v in zip(names[j:j + args.batch], values):
                p.set(n, v)
            p.execute()
        t1 = time.perf_counter()
        for j in range(0, len(names), args.batch):
            p = plain.pipeline(transaction=False)
            for n in names[j:j + args.batch]:
                p.get(n)
            assert all(v is not None for v in p.execute())
        return {"put": size * len(keys) / (t1 - t0) / 1e9, "get": size * len(keys) / (time.perf_counter() - t1) / 1e9}

    clients = {"kvtier": lambda _: backend_run(direct), "kvtier-redispy": lambda _: backend_run(fallback),
               "redis-py": plain_run}
    got = run_interleaved(args.runs, clients, lambda r, name, res: log(
        f"[run {r + 1}/{args.runs}] {name}: put {res['put']:.2f} GB/s, get {res['get']:.2f} GB/s"))
    med: dict[str, dict[str, float]] = {n: {op: median([x[op] for x in v]) for op in ("put", "get")} for n, v in got.items()}
    bench = server.bench_GBps(size) if server is not None else {}
    if bench:
        med["redis-benchmark"] = {"put": bench["SET"], "get": bench["GET"]}
    top = med.get("redis-benchmark")
    print_table(["client", "SET GB/s", "GET GB/s", "SET / redis-benchmark", "GET / redis-benchmark"],
                [[n, f"{m['put']:.2f}", f"{m['get']:.2f}", f"{m['put'] / top['put']:.0%}" if top else None,
                  f"{m['get'] / top['get']:.0%}" if top else None] for n, m in med.items()])
    doc: dict[str, Any] = {"benchmark": "g4_backend", "value_bytes": size, "values": args.values, "batch": args.batch,
                           "runs": got, "median_GBps": med}
    print(f"wrote {write_json(args.out, doc)}")
    for b in (direct, fallback):
        b.delete(keys)
        b.close()
    plain.delete(*names)
    plain.close()
    if server is not None:
        server.close()
    work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""What a G3 load could move with no engine around it: G3's read pattern in C alone, on one medium.

The same bytes as a G3 hit (by default the demo model's: 16-token offload blocks of 30 layers' K
and V, 60 pieces of 12 KiB each per entry, five entries per 4 MiB file; `--tokens 8000` of them)
are written to files under `--dir`, then read back by C threads (benchmarks/native/g3_read_bound.c)
five ways, interleaved, each at 1, 2 and 4 threads:

  raw read      one pread per whole file into a reused buffer (what offload.py's "raw parallel
                read" does, without Python's threads around it);
  into G1       per entry, one preadv of its pieces into a G1-shaped tensor (blocks laid out as
                the engine's cache is), as G3 reads straight into G1;
  into G1 + check   the same, plus the entry's XXH3-128 over its pieces: the `xxhash` package's
                own functions, as G3 checks (kvstore/native/read_entries.c);
  via cache (+ check)   per entry, one pread into a reused buffer that stays in the cache (the
                check taken there), then memcpy into the pieces: staging, tried against reading
                straight into G1 (docs/performance/tier-io.md, ninth pass).

The third row is the bound a load's C work sets; the gap between it and offload.py's "load GB/s"
is the engine's own cost per entry (Python in the readers and the transfer thread).

    .venv/bin/python benchmarks/g3_read_bound.py
    .venv/bin/python benchmarks/g3_read_bound.py --dir /mnt/nvme/g3 --tokens 32000

Writes benchmarks/results/g3_read_bound.json.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from _common import RESULTS_DIR, log, machine_info, median, print_table, write_json  # noqa: E402
from kvstore.clib import compiler  # noqa: E402
from kvstore.native import _xxh3_functions  # noqa: E402

MODES = {"raw read": 0, "into G1": 1, "into G1 + check": 2, "via cache": 3, "via cache + check": 4}


def build(workdir: Path) -> ctypes.CDLL:
    so = workdir / "g3_read_bound.so"
    subprocess.run([compiler("CC", ("gcc", "cc")), "-O2", "-fPIC", "-shared", "-std=c11", "-D_GNU_SOURCE", "-pthread",
                    str(_HERE / "native" / "g3_read_bound.c"), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    p = ctypes.c_void_p
    lib.g3_bound_run.restype = ctypes.c_double
    lib.g3_bound_run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int64, p, ctypes.c_int64, ctypes.c_int64, p, p]
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where the files go (default %(default)s: a tmpfs)")
    ap.add_argument("--tokens", type=int, default=8000, help="tokens of KV read per round (default %(default)s)")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per entry (default %(default)s)")
    ap.add_argument("--pieces", type=int, default=60, help="pieces per entry: layers x K/V (default %(default)s)")
    ap.add_argument("--token-bytes", type=int, default=768,
                    help="bytes per token per piece: kv heads x head size x dtype (default %(default)s: 3 x 64 x 4)")
    ap.add_argument("--file-mib", type=float, default=4.0, help="file size cap in MiB (default %(default)s: G3's)")
    ap.add_argument("--threads", default="1,2,4", help="reader threads to try (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per mode and thread count; medians (default %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "g3_read_bound.json", help="JSON (default %(default)s)")
    args = ap.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: a comma-separated list of integers; got {args.threads!r}")
    if min(threads) < 1 or max(threads) > 64:
        ap.error("--threads: each between 1 and 64")
    if min(args.tokens, args.block_tokens, args.pieces, args.token_bytes, args.rounds) < 1:
        ap.error("--tokens, --block-tokens, --pieces, --token-bytes and --rounds must be positive")
    piece = args.block_tokens * args.token_bytes
    entry = piece * args.pieces
    per_file = max(1, int(args.file_mib * 2**20) // entry)
    entries = -(-args.tokens // args.block_tokens)
    nfiles = -(-entries // per_file)
    total = nfiles * per_file * entry
    nblocks = 2 * nfiles * per_file  # rounds alternate between two halves, as loads land in other blocks
    # Page-aligned, as the engine's cache is under tcmalloc (and nearly so under glibc): where a
    # piece's address runs a few bytes ahead of its file offset's place in its page (np.empty's
    # 16 bytes past a page), the kernel's copy hits 4K aliasing and ran at 40% of its rate here
    g1 = np.empty(nblocks * entry + 4096, dtype=np.uint8)
    g1 = g1[-g1.ctypes.data % 4096:][:nblocks * entry]
    g1.fill(0)  # touched, as the engine's cache is (np.zeros would map untouched zero pages)
    fns = _xxh3_functions()
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(dir=args.dir) as data:
        lib = build(Path(work))
        rng = np.random.default_rng(0)
        want = 0  # what mode 2 must find: its hashes are of the bytes on disk, or it read wrong
        for f in range(nfiles):
            raw = rng.integers(0, 256, per_file * entry, dtype=np.uint8).tobytes()
            Path(data, f"f{f}").write_bytes(raw)
            want += sum(xxhash.xxh3_128_intdigest(raw[e * entry:(e + 1) * entry]) & (2**64 - 1) for e in range(per_file))
        want %= 2**64
        found = ctypes.c_uint64(0)
        log(f"{nfiles} files of {per_file} entries ({per_file * entry / 2**20:.2f} MiB) under {data}; "
            f"{total / 1e6:.1f} MB a round")
        secs: dict[tuple[str, int], list[float]] = {(m, t): [] for m in MODES for t in threads}
        for r in range(args.rounds):
            for (mode, t), got in secs.items():
                s = lib.g3_bound_run(data.encode(), MODES[mode], t, nfiles, per_file, args.pieces, piece,
                                     g1.ctypes.data, nblocks, (r % 2) * nfiles * per_file, ctypes.byref(fns),
                                     ctypes.byref(found))
                if s < 0:
                    raise SystemExit(f"a read failed in mode {mode!r} with {t} threads")
                if MODES[mode] in (2, 4) and found.value != want:
                    raise SystemExit(f"mode {mode!r} with {t} threads hashed other bytes than the files hold")
                got.append(s)
        shutil.rmtree(data, ignore_errors=True)
    rows, results = [], []
    raw = {t: total / median(secs[("raw read", t)]) / 1e9 for t in threads}
    for (mode, t), got in secs.items():
        gbps = total / median(got) / 1e9
        results.append({"mode": mode, "threads": t, "seconds": got, "GBps": gbps, "of_raw_read": gbps / raw[t]})
        rows.append([mode, t, f"{median(got) * 1e3:.1f}", f"{gbps:.2f}", f"{100 * gbps / raw[t]:.0f}%"])
    print_table(["mode", "threads", "ms (median)", "GB/s", "of the raw read, same threads"], rows)
    m = machine_info()
    print(f"{total / 1e6:.1f} MB in {nfiles} files on {args.dir}; {m.get('cpu_model')}, {os.cpu_count()} CPUs")
    path = write_json(args.out, {"workload": {"dir": str(args.dir), "tokens": args.tokens, "entry_bytes": entry,
                                              "pieces": args.pieces, "entries_per_file": per_file, "files": nfiles,
                                              "bytes_per_round": total, "rounds": args.rounds},
                                 "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`kvtier extract --data-parallel-size N`: N shard processes, each an engine on its share of the
CPUs taking the lines `server.extract.shard_of` gives it, all appending to the one manifest (one
`write(2)` per batch on an O_APPEND descriptor). The parent holds the output directory's lock and
repairs the manifest before they start; a shard loads it without repairing."""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import zlib
from pathlib import Path

from engine.parallel.ranks import cpu_sets
from server.extract import PROG, ConfigError, LineError, line_id, run_shard
from server.extract_manifest import Manifest


def run_data_parallel(ns: argparse.Namespace, src: Path, out: Path, layer_ids: list[int]) -> int:
    """N shard processes on disjoint CPUs, the manifest repaired once here first. The exit code is
    the worst of theirs (130 if any was interrupted, else 1 if any line failed)."""
    manifest = Manifest(out, layer_ids)
    try:
        manifest.load()
    except ValueError as e:  # LayerMismatch
        raise ConfigError(str(e)) from None
    n = ns.data_parallel_size
    ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads
    procs = [ctx.Process(target=shard_main, args=(ns, src, out, layer_ids, k, n, cpus), name=f"extract-dp{k}")
             for k, cpus in enumerate(cpu_sets(n))]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:  # the shards got the same Ctrl-C: they stop their batches and report
        for p in procs:
            p.join()
    codes = [p.exitcode for p in procs]
    return 130 if 130 in codes else 2 if 2 in codes else 1 if any(codes) else 0


def _die_with_parent() -> None:
    """A shard must not outlive the parent that holds the directory's lock: a rerun would take the
    lock while it still writes. Linux's PR_SET_PDEATHSIG kills it with its parent, SIGKILL included."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before the call
        raise SystemExit(1)


def shard_main(ns: argparse.Namespace, src: Path, out: Path, layer_ids: list[int], shard: int, shards: int,
               cpus: tuple[int, ...]) -> None:
    _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)
    logging.basicConfig(level=ns.log_level.upper(), format=f"%(levelname)s dp{shard} %(name)s: %(message)s")
    try:
        code = run_shard(ns, src, out, layer_ids, shard, shards)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    raise SystemExit(code)


def shard_of(lineno: int, raw: bytes, shards: int) -> int:
    """Which data-parallel shard takes a line: by its id, so a duplicate id lands where its first
    line is (and fails there); a line without a readable id by its number."""
    if shards == 1:
        return 0
    try:
        obj = json.loads(raw)
        return zlib.crc32(line_id(obj, lineno).encode()) % shards if isinstance(obj, dict) else lineno % shards
    except (json.JSONDecodeError, UnicodeDecodeError, LineError):
        return lineno % shards

"""Model identity for persistent tiers: KV made by one model/dtype is never served to another.

The G3/G4 namespace digests the architecture facts (`ModelConfig.fingerprint`: geometry, rope,
dtype), the block size, the layout version and the weights' identity: a digest of every byte of
every weight file (xxh3-128, streamed), so two checkpoints that differ in one weight byte get
different namespaces. An operator may name the weights instead (`kv_namespace`); the other facts
still apply, so a dtype or block-size change cannot alias under one name.

Hashing a large checkpoint takes seconds, so each file's digest is cached in
`.kvtier-weights-digest.json` beside it or, when the model directory is read-only, in
`$KVTIER_CACHE_DIR` / `$XDG_CACHE_HOME/kvtier` / `~/.cache/kvtier` under `weights-digests/`,
keyed by the directory's absolute path. A cached digest is used only while the file's size,
device, inode, mtime_ns and ctime_ns are unchanged. ctime is what a copy cannot fool: `cp -p`,
`rsync -t` or a restored backup can put back a file's size, inode and mtime after rewriting it in
place, but user space cannot set ctime, and every write, chmod or utime moves it. A cache that
cannot be read or written costs a rehash, never a failed start.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from kvstore.cache_dir import cache_root
from engine.model_config import ModelConfig
from engine.runner.loader import weight_files

try:
    import xxhash
except ImportError:  # a dependency; blake2b keeps a broken install working (another namespace)
    xxhash = None

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
ALGORITHM = "xxh3_128" if xxhash is not None else "blake2b_128"
CACHE_NAME = ".kvtier-weights-digest.json"
CACHE_VERSION = 2  # 2: entries keyed by ctime_ns and st_dev too (version 1's are rehashed once)
CHUNK_BYTES = 16 << 20  # large reads into one reused buffer: hashing, not syscalls, is the cost
# A file changed this recently may change again within one timestamp tick (the kernel stamps
# with a coarse clock) without its stat changing, so its digest is not cached. Measured on
# ctime: it moves with every change, while mtime can be set back.
RACY_NS = 2_000_000_000
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")


def hash_file(path: Path, buf: bytearray) -> str:
    """Hex digest of every byte of `path`, read in `len(buf)` chunks into `buf`."""
    h = xxhash.xxh3_128() if xxhash is not None else hashlib.blake2b(digest_size=16)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "dev": st.st_dev}


def fallback_cache_path(model_dir: Path) -> Path:
    """The per-user digest cache of `model_dir` (for read-only model directories)."""
    name = hashlib.sha256(str(model_dir).encode()).hexdigest()[:32]
    return cache_root() / "weights-digests" / f"{name}.json"


def _read_cache(path: Path, model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.debug("ignoring weights digest cache %s: %s", path, e)
        return {}
    if (not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("algorithm") != ALGORITHM
            or data.get("dir") != str(model_dir) or not isinstance(data.get("files"), dict)):
        return {}
    return data["files"]


def _write_cache(model_dir: Path, files: dict[str, Any]) -> None:
    data = json.dumps({"version": CACHE_VERSION, "algorithm": ALGORITHM, "dir": str(model_dir), "files": files},
                      indent=1, sort_keys=True)
    errors = []
    for path in (model_dir / CACHE_NAME, fallback_cache_path(model_dir)):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(data)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new cache
            log.debug("weights digests cached in %s", path)
            return
        except OSError as e:
            errors.append(f"{path}: {e.strerror or e}")
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # e.g. its directory could not be created: there is no temp file
                pass
    log.warning("cannot cache the weights digest (%s); the next start hashes the weights again", "; ".join(errors))


def weights_identity(model_dir: Path) -> str:
    """Digest of every byte of the model's weight files (see the module docstring)."""
    model_dir = Path(model_dir).absolute()
    names = weight_files(model_dir)
    cached: dict[str, Any] = {}
    for path in (fallback_cache_path(model_dir), model_dir / CACHE_NAME):  # the one beside the model wins
        cached.update(_read_cache(path, model_dir))
    entries: dict[str, Any] = {}
    fresh = hashed_files = hashed_bytes = 0
    buf: bytearray | None = None
    start = time.perf_counter()
    for name in names:
        path = model_dir / name
        key = _stat_key(os.stat(path))
        hit = cached.get(name)
        if (isinstance(hit, dict) and {k: hit.get(k) for k in key} == key
                and isinstance(hit.get("digest"), str) and _DIGEST_RE.fullmatch(hit["digest"])):
            entries[name] = hit
            continue
        buf = buf if buf is not None else bytearray(min(CHUNK_BYTES, max(key["size"], 1 << 16)))
        began_ns = time.time_ns()
        digest = hash_file(path, buf)
        hashed_files += 1
        hashed_bytes += key["size"]
        after = _stat_key(os.stat(path))
        if after == key and began_ns - max(key["mtime_ns"], key["ctime_ns"]) >= RACY_NS:
            entries[name] = {**key, "digest": digest}
            fresh += 1
        else:  # changed while hashing, or too recently: use the digest now, never cache it
            entries[name] = {**after, "digest": digest, "uncached": True}
    took = time.perf_counter() - start
    if hashed_files:
        log.info("weights identity of %s: hashed %d file(s), %.2f GB, in %.2f s (%.2f GB/s); %d from the digest cache",
                 model_dir, hashed_files, hashed_bytes / 1e9, took, hashed_bytes / 1e9 / max(took, 1e-9),
                 len(names) - hashed_files)
    else:
        log.info("weights identity of %s: %d file(s) from the digest cache (%.3f s)", model_dir, len(names), took)
    if fresh:
        _write_cache(model_dir, {n: e for n, e in entries.items() if not e.get("uncached")})
    h = hashlib.sha256(ALGORITHM.encode())
    for name in names:
        h.update(json.dumps([name, entries[name]["size"], entries[name]["digest"]]).encode())
    return h.hexdigest()


def fingerprint_description(model_dir: Path, cfg: ModelConfig, block_size: int,
                            kv_namespace: str | None = None) -> dict[str, Any]:
    """What a namespace digests (a JSON object): the architecture facts, the weights' identity or
    `kv_namespace` in its place (which skips hashing them), the block size and the layout version."""
    weights = {"kv_namespace": kv_namespace} if kv_namespace is not None else {"weights": weights_identity(model_dir)}
    return {**cfg.fingerprint(), **weights, "block_size": block_size, "layout_version": LAYOUT_VERSION}


def namespace_digest(desc: dict[str, Any]) -> bytes:
    """The 16-byte namespace of a `fingerprint_description`."""
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()[:16]
    named = desc.get("kv_namespace")
    log.info("KV namespace %s (weights named %s)", digest.hex(),
             f"by kv_namespace {named!r}" if named is not None else "by the digest of every byte")
    return digest


def model_fingerprint(model_dir: Path, cfg: ModelConfig, block_size: int, kv_namespace: str | None = None) -> bytes:
    """16-byte namespace of this model's KV. `kv_namespace` replaces only the weights' identity
    (and skips hashing them); the architecture, dtype and block size always count."""
    return namespace_digest(fingerprint_description(model_dir, cfg, block_size, kv_namespace))

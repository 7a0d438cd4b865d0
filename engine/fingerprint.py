"""Model identity for persistent tiers: KV made by one model/dtype is never served to another."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from engine.config import ModelConfig

LAYOUT_VERSION = 1
_SAMPLE = 1 << 16


def weights_identity(model_dir: Path) -> str:
    """sha256 over each safetensors file's header (names, dtypes, shapes) and samples of its
    data (start, middle, end): cheap at start-up, and different for different weights."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(n))
            size = f.stat().st_size
            for off in (8 + n, max(8 + n, (size + n) // 2), max(8 + n, size - _SAMPLE)):
                fh.seek(off)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def model_fingerprint(model_dir: Path, cfg: ModelConfig, block_size: int) -> bytes:
    desc = {**cfg.fingerprint(), "weights": weights_identity(model_dir), "block_size": block_size,
            "layout_version": LAYOUT_VERSION}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()[:16]

"""kvtier's per-user cache directory: `$KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier`, else
`~/.cache/kvtier` (the converted demo model, weights digests of read-only model directories, the C libraries built
on first use)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    explicit = os.environ.get("KVTIER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvtier"

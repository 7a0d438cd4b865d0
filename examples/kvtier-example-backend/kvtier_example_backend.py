"""An out-of-tree kvtier storage backend: one file per key in a directory.

Writes go to a temp file in the same directory and are published with `os.replace`, which
is atomic, so concurrent readers need no lock: they open the old file, the new one, or
nothing. There is no capacity or eviction; kvtier's own G3 tier (`kvstore.disk`) shows
those, along with checksums.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from connectors.backend import BackendError, StorageBackend, check_blocks, check_keys


class DirBackend(StorageBackend):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"DirBackend {self.root} is closed")

    def _path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}.blk"

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        self._check_open()
        return [self._path(k).exists() for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_keys(keys)
        self._check_open()
        out: list[bytes | None] = []
        for k in keys:
            try:
                out.append(self._path(k).read_bytes())
            except FileNotFoundError:
                out.append(None)
        return out

    def put(self, keys: Sequence[bytes], blocks: Sequence[bytes | memoryview]) -> list[bool]:
        views = check_blocks(keys, blocks)  # validates everything before storing anything
        self._check_open()
        return [self._write(k, v) for k, v in zip(keys, views)]

    def _write(self, key: bytes, view: memoryview) -> bool:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{key.hex()}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(view)
            os.replace(tmp, self._path(key))
        except OSError:  # full or unwritable: refuse this block, as the contract asks
            Path(tmp).unlink(missing_ok=True)
            return False
        return True

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        self._check_open()
        for k in keys:
            self._path(k).unlink(missing_ok=True)

    def close(self) -> None:
        self._closed = True

"""G3's namespace directory on disk: where entry files live and how they get there.

`NamespaceDir` owns the directory's path and the shard directories known to exist; it creates
them, lists, writes and publishes files, and removes them. It keeps no index: `DiskBackend`
decides what to write and remove (under its lock) and counts what happened.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from kvstore.disk_files import write_temp
from kvstore.disk_index import FileName
from kvstore.disk_layout import entry_path, list_files, remove_entry_path

logger = logging.getLogger("kvstore.disk")  # the tier's own log lines, as before the split


class NamespaceDir:
    def __init__(self, root: Path, namespace: bytes) -> None:
        self.root = root
        self.path = str(root / namespace.hex())
        self._shards: set[str] = set()  # shard directories known to exist

    def create(self) -> OSError | None:
        """Makes the directory (0700) if missing; the error when it cannot be made or written."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:
                pass
        except OSError as e:
            return e
        if not os.access(self.path, os.W_OK):
            return PermissionError(f"{self.path} is not writable")
        return None

    def listing(self, regular_only: bool = True) -> list[tuple[str, str]]:
        """(shard directory, file name) of every file under the namespace directory."""
        out = list_files(self.path, lambda path, e: logger.warning("G3 cannot list %s: %s", path, e), regular_only)
        self._shards.update(shard for shard, _ in out)
        return out

    def entry(self, name: FileName) -> str:
        return entry_path(self.path, name)

    def write(self, name: FileName, parts: list[memoryview], fsync: bool) -> str:
        """`parts` in a fresh temp file beside `name`'s path, for `publish`. Raises OSError."""
        return write_temp(self.path, name, parts, fsync, self._shards)

    def publish(self, tmp: str, path: str) -> bool:
        """Renames `tmp` to `path`; True when a directory planted at `path` had to be removed
        first (rename cannot replace it): that is removed and published over, rather than taken
        for a failing disk that stops every write. Raises OSError."""
        try:
            os.replace(tmp, path)
            return False
        except OSError as e:
            if not os.path.isdir(path) or os.path.islink(path):
                raise
            logger.warning("G3 removing a directory at entry path %s (%s)", path, e.strerror or e)
            remove_entry_path(path)
            os.replace(tmp, path)
            return True

    def unlink(self, name: FileName) -> None:
        try:
            remove_entry_path(self.entry(name))
        except OSError as e:  # e.g. a read-only file system: the file outlives its entries
            logger.debug("G3 cannot remove %s: %s", self.entry(name), e)

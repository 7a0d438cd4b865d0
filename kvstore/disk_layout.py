"""The G3 directory layout and its file helpers, shared by the tier (`disk.py`) and the
`kvtier kv` tools, so that both agree on what is an entry, a temp file or a stranger.

    {root}/{namespace.hex()}/{key.hex()[:2]}/{key.hex()}.kvb       an entry (`kvstore.entry`)
    {root}/{namespace.hex()}/{key.hex()[:2]}/.{key.hex()}.{pid}.{random}.tmp   a write in flight
    {root}/{namespace.hex()}/namespace.json                       which model (`kvstore.namespace_info`)

Directories are 0700 and files 0600. Any other name is not kvtier's and is left alone.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Callable

from kvstore.keys import BlockKey

logger = logging.getLogger(__name__)

NAMESPACE_RE = re.compile(r"[0-9a-f]{32}")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_ENTRY_RE = re.compile(r"([0-9a-f]{32})\.kvb")
_TMP_RE = re.compile(r"\.[0-9a-f]{32}\.(\d+)\.[0-9a-f]+\.tmp")


def entry_path(ns_dir: str, key: BlockKey) -> str:
    h = key.hex()
    return os.path.join(ns_dir, h[:2], h + ".kvb")


def temp_path(ns_dir: str, key: BlockKey) -> str:
    """A fresh temp file name for a write of `key` by this process, in the entry's shard."""
    h = key.hex()
    return os.path.join(ns_dir, h[:2], f".{h}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def entry_key(name: str) -> BlockKey | None:
    """The key an entry file's name says it holds; None if `name` is not an entry's."""
    m = _ENTRY_RE.fullmatch(name)
    return BlockKey(bytes.fromhex(m[1])) if m else None


def temp_writer(name: str) -> int | None:
    """The pid of the process that wrote a temp file; None if `name` is not a temp file's."""
    m = _TMP_RE.fullmatch(name)
    return int(m[1]) if m else None


def list_files(ns_dir: str, on_error: Callable[[str, OSError], None]) -> list[tuple[str, str]]:
    """(shard directory, file name) of every file in a namespace directory's shards; a
    directory that cannot be listed is reported to `on_error` and skipped (missing: empty)."""
    out: list[tuple[str, str]] = []
    try:
        shards = [e.path for e in os.scandir(ns_dir) if _SHARD_RE.fullmatch(e.name) and e.is_dir()]
    except FileNotFoundError:
        return out
    except OSError as e:
        on_error(ns_dir, e)
        return out
    for shard in shards:
        try:
            out.extend((shard, e.name) for e in os.scandir(shard) if e.is_file(follow_symlinks=False))
        except OSError as e:
            on_error(shard, e)
    return out


def write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        view = view[os.write(fd, view) :]


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.debug("cannot remove %s: %s", path, e)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # makes the rename itself durable
        finally:
            os.close(fd)
    except OSError as e:  # the entry is published either way; only its durability is weaker
        logger.debug("cannot fsync directory %s: %s", path, e)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return True

"""The G3 directory layout and its file helpers, shared by the tier (`disk.py`) and the
`kvtier kv` tools, so that both agree on what is an entry, a temp file or a stranger.

    {root}/{namespace.hex()}/{key.hex()[:2]}/{key.hex()}.kvb       an entry (`kvstore.entry`)
    {root}/{namespace.hex()}/{key.hex()[:2]}/.{key.hex()}.{pid}.{random}.tmp   a write in flight
    {root}/{namespace.hex()}/namespace.json                       which model (`kvstore.namespace_info`)

Directories are 0700 and files 0600. Any other name is not kvtier's and is left alone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import stat
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


class NotRegularFile(OSError):
    """Something other than a regular file (a FIFO, device node, directory, socket or symlink)
    where an entry should be."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "non-regular file"


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """(read-only fd, its stat) of the regular file at `path`; NotRegularFile for anything else.

    A plain open() of a FIFO blocks until a writer comes (forever, for a planted one), and a read
    of a device node may block or never end; a symlink could point anywhere. So the path is
    lstat'ed first (a device is never opened), then opened without following a link and without
    blocking, and the fd's own stat is checked again (the path may have been swapped in between).
    O_NONBLOCK changes nothing for a regular file's reads."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def not_regular(path: str, mode: int) -> NotRegularFile:
    """The error for a `mode` that is not a regular file's where an entry should be."""
    return NotRegularFile(errno.EINVAL, f"a {_kind(mode)}, not a regular file", path)


def reason(e: Exception) -> str:
    """A log line's reason: an OSError's text without the path the line already names."""
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def remove_entry_path(path: str) -> None:
    """Removes whatever is at an entry's path: a file, a link, a FIFO, or a directory planted
    there (with its contents: `shutil.rmtree` never follows links out of it). Raises OSError
    when it cannot; FileNotFoundError is not an error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path)
    except PermissionError:  # some systems refuse unlink(dir) with EPERM
        if not os.path.isdir(path) or os.path.islink(path):
            raise
        shutil.rmtree(path)


def list_files(ns_dir: str, on_error: Callable[[str, OSError], None],
               regular_only: bool = True) -> list[tuple[str, str]]:
    """(shard directory, name) of every file in a namespace directory's shards (with
    `regular_only=False`, of everything in them: FIFOs, links, directories too); a directory
    that cannot be listed is reported to `on_error` and skipped (missing: empty)."""
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
            out.extend((shard, e.name) for e in os.scandir(shard) if not regular_only or e.is_file(follow_symlinks=False))
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

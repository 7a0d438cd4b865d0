"""G3's settings: what a DiskBackend is given, validated on construction."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.backend import IO_BYTES
from kvstore.entry import check_secret
from kvstore.keys import KEY_BYTES
from kvstore.namespace_info import check_info
from policies import PolicySpecLike


@dataclass(frozen=True)
class DiskConfig:
    root: Path
    capacity_bytes: int  # header + payload bytes of all entries
    namespace: bytes  # 16-byte model fingerprint digest
    policy: PolicySpecLike = "lru"  # a policies.make_policy spec
    fsync: bool = False  # fsync file and directory per write: power-loss durability, slower
    retry_after_s: float = 30.0  # back-off before writing again after a write error
    # KV secret: entries carry keyed MACs and unkeyed ones are rejected (see kvstore.entry)
    secret: bytes | None = field(default=None, repr=False)
    # A typical entry's payload bytes: the policy's capacity is capacity_bytes // (header + this)
    # entries (approximate where entries differ, as with KV groups); None: unknown.
    entry_bytes: int | None = None
    # Reads count as uses. The connector turns it off: it reports each read that served a request
    # through touch_blocks, with the block's metadata, so no use counts twice.
    touch_on_read: bool = True
    # What the namespace is (model, dtype, ...): written to {root}/{namespace}/namespace.json for
    # the `kvtier kv` tools (kvstore.namespace_info); informational, never read back by the tier.
    info: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    file_bytes: int = IO_BYTES  # the most bytes one file gathers from a put (a single entry may exceed it)
    # Reads through the native loop (kvstore.native) where it builds; False: Python's reads, the
    # same checks and results (tests compare the two).
    native_io: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        check_secret(self.secret)
        check_info(self.info)
        if type(self.namespace) is not bytes or len(self.namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes (a fingerprint digest), got {self.namespace!r}")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.file_bytes < 1:
            raise ValueError(f"file_bytes must be >= 1, got {self.file_bytes}")
        if self.entry_bytes is not None and self.entry_bytes < 1:
            raise ValueError(f"entry_bytes must be >= 1 or None, got {self.entry_bytes}")

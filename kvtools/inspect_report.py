"""What the `kvtier kv` tools report about a G3 directory or a G4 Redis, and the checks they share.

`inspect_disk` and `inspect_redis` read a tier the way the tier itself does (same layout, same
entry checks: `check_entry`) and return the reports defined here; `kvtools/cli.py` prints them.

Verification outcomes of one entry:
- good: every check the tier makes on a read passed (header, namespace and key, size, payload
  checksum or MAC);
- bad: a check failed, so the tier would count it corrupt, delete it and never serve it;
- unverified: a keyed entry (MAC'd with a KV secret) and no secret was given: nothing can be
  said about it, so it is listed as such, never called corrupt and never removed.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.entry import HEADER_SIZE, CorruptEntry, EntryCodec, EntryHeader, looks_keyed
from kvstore.keys import KEY_BYTES
from kvstore.namespace_info import model_label
from kvstore.remote import check_url, redact

# Age buckets, by upper bound in seconds; G3 ages are since the entry was written (file mtime),
# G4's since its last access (OBJECT IDLETIME: Redis keeps no write time).
AGE_BUCKETS: tuple[tuple[float, str], ...] = ((60, "<1m"), (3600, "<1h"), (86400, "<1d"), (math.inf, ">=1d"))
UNKNOWN_AGE = "unknown"
_NAMESPACE_RE = re.compile(r"[0-9a-f]{32}")

# Exit codes of `kvtier kv verify` (and the meaning of VerifyReport.exit_code).
EXIT_CLEAN, EXIT_BAD, EXIT_UNVERIFIED = 0, 1, 3


class Unverifiable(Exception):
    """A keyed entry, and the codec has no secret to check it with."""


class TierUnavailable(Exception):
    """The tier could not be read at all (unreachable server, refused credentials, unlistable root)."""


def age_bucket(age_s: float | None) -> str:
    """The AGE_BUCKETS label of an age (a clock step back, age < 0, counts as new); None: unknown."""
    if age_s is None:
        return UNKNOWN_AGE
    return next(label for bound, label in AGE_BUCKETS if age_s < bound)


def empty_ages() -> dict[str, int]:
    return {label: 0 for _, label in AGE_BUCKETS}


def parse_namespace(text: str) -> bytes:
    """A namespace given on the command line: 32 hex digits (the directory name / key part)."""
    value = text.strip().lower()
    if not _NAMESPACE_RE.fullmatch(value):
        raise ValueError(f"a namespace is {KEY_BYTES * 2} hex digits (as `kvtier kv inspect` lists them); got {text!r}")
    return bytes.fromhex(value)


def check_prefix(prefix: str) -> None:
    """The G4 key prefix rule of `RemoteConfig` (non-empty, no whitespace)."""
    if not prefix or any(c.isspace() for c in prefix):
        raise ValueError(f"the key prefix must be non-empty without whitespace; got {prefix!r}")


@dataclass(frozen=True)
class DirTarget:
    root: Path

    def __post_init__(self) -> None:
        if not self.root.is_dir():
            raise ValueError(f"{self.root} is not a directory" if self.root.exists() else f"{self.root} does not exist")


@dataclass(frozen=True)
class RedisTarget:
    url: str = field(repr=False)  # may hold a password: `location` is what gets printed

    def __post_init__(self) -> None:
        check_url(self.url)

    @property
    def location(self) -> str:
        return redact(self.url)


def parse_target(spec: str) -> DirTarget | RedisTarget:
    """A G4 URL (redis://, rediss://, redis+cluster://, ...) or an existing G3 directory; ValueError otherwise."""
    if "://" in spec:
        return RedisTarget(spec)
    return DirTarget(Path(spec).expanduser())


def check_entry(codec: EntryCodec, raw: bytes, namespace: bytes, key: bytes | None, size: int,
                exact: bool = True) -> EntryHeader:
    """The header checks the tiers make (`kvstore.disk_files.check_entry`, `RedisBackend._open`):
    format and header sum/MAC, the namespace and key the entry is stored under (None: any, for a
    G3 file's entries after its first), its total `size` (with `exact` False, the most it may
    have: the bytes left in a G3 file). Raises CorruptEntry, or Unverifiable for a keyed entry
    when `codec` has no secret."""
    if not codec.keyed and looks_keyed(raw):
        raise Unverifiable("keyed entry (MAC'd with a KV secret); no secret given to check it")
    head = codec.open_header(raw)
    if head.namespace != namespace:
        raise CorruptEntry(f"written for namespace {head.namespace.hex()}, stored under {namespace.hex()}")
    if key is not None and head.key != key:
        raise CorruptEntry(f"holds key {head.key.hex()}, not the one it is stored under")
    if size != HEADER_SIZE + head.payload_len and (exact or size < HEADER_SIZE + head.payload_len):
        raise CorruptEntry(f"size {size}, header says {HEADER_SIZE + head.payload_len} (torn or truncated)")
    return head


@dataclass
class NamespaceUsage:
    """One namespace's entries (a builder: counts grow as the tool reads the tier)."""

    namespace: str  # 32 hex digits
    record: dict[str, Any] | None = None  # its namespace record (kvstore.namespace_info), if readable
    entries: int = 0
    bytes: int = 0
    ages: dict[str, int] = field(default_factory=empty_ages)

    def add(self, size: int, age_s: float | None, entries: int = 1) -> None:
        self.entries += entries
        self.bytes += size
        label = age_bucket(age_s)
        self.ages[label] = self.ages.get(label, 0) + entries

    @property
    def model(self) -> str:
        return model_label(self.record)

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "model": self.model, "record": self.record, "entries": self.entries,
                "bytes": self.bytes, "ages": dict(self.ages)}


def _sum_ages(parts: list[Mapping[str, int]]) -> dict[str, int]:
    total = empty_ages()
    for ages in parts:
        for label, n in ages.items():
            total[label] = total.get(label, 0) + n
    return total


def _check_counts(obj: object, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(obj, name)}")


@dataclass(frozen=True)
class Summary:
    """`kvtier kv inspect`: entries and bytes per namespace, and what else is there."""

    tier: str  # "G3" or "G4"
    location: str  # the directory, or the URL without its password
    age_basis: str  # what an age is measured from (see AGE_BUCKETS)
    namespaces: tuple[NamespaceUsage, ...]
    in_flight: int = 0  # temp files of live writers (G3)
    stale: int = 0  # temp files of writers that are gone (G3; the tier removes them at start-up)
    foreign: int = 0  # names that are not kvtier's, left alone
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_counts(self, "in_flight", "stale", "foreign")

    @property
    def entries(self) -> int:
        return sum(n.entries for n in self.namespaces)

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.namespaces)

    @property
    def ages(self) -> dict[str, int]:
        return _sum_ages([n.ages for n in self.namespaces])

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "location": self.location, "entries": self.entries, "bytes": self.bytes,
                "age_basis": self.age_basis, "ages": self.ages, "namespaces": [n.to_dict() for n in self.namespaces],
                "temp_files": {"in_flight": self.in_flight, "stale": self.stale}, "foreign": self.foreign,
                "notes": list(self.notes)}


@dataclass(frozen=True)
class Problem:
    """A bad entry (or a stale temp file): where (a path or a Redis key), why, and whether it was removed."""

    where: str
    reason: str
    removed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"where": self.where, "reason": self.reason, "removed": self.removed}


@dataclass(frozen=True)
class VerifyReport:
    """`kvtier kv verify`: every entry read and checked."""

    tier: str
    location: str
    checked: int  # entries read (good + bad + unverified)
    good: int
    bad: tuple[Problem, ...]
    unverified: tuple[str, ...]  # keyed entries, no secret given
    in_flight: int = 0  # live writers' temp files, left alone
    foreign: int = 0
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_counts(self, "checked", "good", "in_flight", "foreign")

    @property
    def exit_code(self) -> int:
        """EXIT_BAD if anything is bad; else EXIT_UNVERIFIED if a keyed entry went unchecked; else EXIT_CLEAN."""
        return EXIT_BAD if self.bad else EXIT_UNVERIFIED if self.unverified else EXIT_CLEAN

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "location": self.location, "checked": self.checked, "good": self.good,
                "bad": [p.to_dict() for p in self.bad], "unverified": list(self.unverified),
                "in_flight": self.in_flight, "foreign": self.foreign, "notes": list(self.notes),
                "exit_code": self.exit_code}


@dataclass(frozen=True)
class ClearReport:
    """`kvtier kv clear`: what was removed and what was left."""

    tier: str
    location: str
    removed: int
    bytes: int | None  # bytes of the removed entries; None where unknown (G4)
    in_flight: int = 0  # live writers' temp files, left alone
    foreign: int = 0
    failed: tuple[Problem, ...] = ()  # files that could not be removed

    def __post_init__(self) -> None:
        _check_counts(self, "removed", "in_flight", "foreign")

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "location": self.location, "removed": self.removed, "bytes": self.bytes,
                "in_flight": self.in_flight, "foreign": self.foreign, "failed": [p.to_dict() for p in self.failed]}

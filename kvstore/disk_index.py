"""G3's index: which file holds each block key, and where in it.

A G3 file holds a run of entries back to back (`kvstore.entry` format each: header, payload) and is
named by its first entry's key, so a one-entry file is the format G3 always wrote. A key's bytes are
one byte range of one file: a load reads just the ranges it needs, and neighbouring ranges of one
file in one call. Space is counted per file: an entry dropped alone (deleted, replaced, damaged)
leaves a hole that is freed with its file's last entry, and eviction drops whole files.

Bookkeeping only: no I/O. The disk backend calls it under its lock.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, KeysView, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.keys import BlockKey

FileName = BlockKey  # a file is named by the key of its first entry


class Loc(NamedTuple):
    file: FileName
    offset: int  # of the entry's header
    size: int  # header + payload


Ident = tuple[int, int]  # (st_dev, st_ino) of a file as published or scanned


@dataclass
class _File:
    size: int
    ident: Ident | None
    live: set[BlockKey] = field(default_factory=set)


class DiskIndex:
    def __init__(self) -> None:
        self._loc: dict[BlockKey, Loc] = {}
        self._files: dict[FileName, _File] = {}
        self._used = 0  # bytes of indexed files, holes included

    @property
    def used(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._loc)

    def __contains__(self, key: object) -> bool:
        return key in self._loc

    def get(self, key: BlockKey) -> Loc | None:
        return self._loc.get(key)

    def locate(self, keys: Sequence[BlockKey],
               sizes: Sequence[int] | None) -> tuple[dict[FileName, list[tuple[int, Loc]]], int]:
        """Where a read of `keys` goes: per file (in the order the keys first name them), the
        indices of its keys with their places, sorted by offset; and how many keys are misses
        (not indexed, or not of `sizes[i]` bytes with the header when sizes are given)."""
        by_file: dict[FileName, list[tuple[int, Loc]]] = {}
        misses = 0
        for i, key in enumerate(keys):
            loc = self._loc.get(key)
            if loc is None or (sizes is not None and sizes[i] != loc.size):
                misses += 1
            else:
                by_file.setdefault(loc.file, []).append((i, loc))
        for wanted in by_file.values():
            wanted.sort(key=lambda w: w[1].offset)
        return by_file, misses

    def keys(self) -> KeysView[BlockKey]:
        return self._loc.keys()

    def has_file(self, name: FileName) -> bool:
        return name in self._files

    def files(self) -> dict[FileName, int]:
        """Every indexed file's size."""
        return {name: f.size for name, f in self._files.items()}

    def keys_of(self, name: FileName) -> list[BlockKey]:
        f = self._files.get(name)
        return [] if f is None else sorted(f.live, key=lambda k: self._loc[k].offset)

    def foreign(self, name: FileName, keys: Collection[BlockKey]) -> list[tuple[BlockKey, Loc]]:
        """The entries a new file called `name` holding `keys` would take from the index (the
        file of that name's live keys not among `keys`), in offset order."""
        f = self._files.get(name)
        if f is None:
            return []
        return sorted(((k, self._loc[k]) for k in f.live if k not in keys), key=lambda kl: kl[1].offset)

    def pick_name(self, keys: Sequence[BlockKey]) -> int:
        """The position in `keys` of the first key that can name a file of them without taking
        another file's entries with it (`foreign`); 0 when none can."""
        held = set(keys)

        def takes_others(name: FileName) -> bool:
            f = self._files.get(name)
            return f is not None and not f.live <= held
        return next((i for i, k in enumerate(keys) if not takes_others(k)), 0)

    def ident(self, name: FileName) -> Ident | None:
        """The identity the file had when indexed: a read that opens another one (replaced since by
        a file of the same name) must not read the old offsets in it."""
        f = self._files.get(name)
        return None if f is None else f.ident

    def add_file(self, name: FileName, size: int, entries: Iterable[tuple[BlockKey, int, int]],
                 ident: Ident | None = None) -> tuple[list[BlockKey], list[FileName]]:
        """Index a file of `size` bytes holding `entries` (key, offset, size). A file of the same
        name is replaced (its keys not in the new one are gone); a key held elsewhere moves here.
        Returns (keys no longer stored, files left empty: the caller removes those)."""
        gone = self.drop_file(name) if name in self._files else []
        new = _File(size, ident)
        self._files[name] = new
        self._used += size
        emptied: list[FileName] = []
        for key, offset, n in entries:
            old = self._loc.get(key)
            if old is not None and old.file != name and self._unlink_key(key, old):
                emptied.append(old.file)
            self._loc[key] = Loc(name, offset, n)
            new.live.add(key)
        return [k for k in gone if k not in new.live], emptied

    def drop_key(self, key: BlockKey) -> FileName | None:
        """Forget one key; returns its file when that was the file's last entry (now forgotten too)."""
        loc = self._loc.pop(key)
        return loc.file if self._unlink_key(key, loc) else None

    def drop_file(self, name: FileName) -> list[BlockKey]:
        """Forget a file and every key it holds; returns those keys."""
        f = self._files.pop(name)
        self._used -= f.size
        for key in f.live:
            del self._loc[key]
        return list(f.live)

    def _unlink_key(self, key: BlockKey, loc: Loc) -> bool:
        f = self._files[loc.file]
        f.live.discard(key)
        if key in self._loc and self._loc[key] == loc:
            del self._loc[key]
        if f.live:
            return False
        del self._files[loc.file]
        self._used -= f.size
        return True

    def check_integrity(self, on_disk: dict[FileName, int]) -> None:
        """RuntimeError unless every key points into a live file of the size on disk, each file's
        entries lie inside it without overlapping, and the byte count adds up."""
        if on_disk != self.files():
            extra = sorted(k.hex() for k in on_disk.keys() - self._files.keys())
            missing = sorted(k.hex() for k in self._files.keys() - on_disk.keys())
            sizes = sorted(k.hex() for k in on_disk.keys() & self._files.keys() if on_disk[k] != self._files[k].size)
            raise RuntimeError(f"index and files differ: unindexed {extra}, missing {missing}, size {sizes}")
        if self._used != sum(f.size for f in self._files.values()):
            raise RuntimeError(f"used {self._used} != {sum(f.size for f in self._files.values())} indexed")
        for name, f in self._files.items():
            if not f.live:
                raise RuntimeError(f"file {name.hex()} indexed with no entries")
            end = 0
            for key in self.keys_of(name):
                loc = self._loc[key]
                if loc.file != name or loc.offset < end or loc.offset + loc.size > f.size:
                    raise RuntimeError(f"entry {key.hex()} at {loc} overlaps or lies outside file {name.hex()}")
                end = loc.offset + loc.size
        if sum(len(f.live) for f in self._files.values()) != len(self._loc):
            raise RuntimeError("keys and files' entries differ")

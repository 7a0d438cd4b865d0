"""`kvtier kv` on a G4 Redis/Valkey: inspect, verify, clear. Safe beside live engines.

The key scheme is `kvstore.remote`'s: entries `{prefix}:{namespace hex}:{key hex}`, namespace
records `{prefix}:{namespace hex}:namespace` (`kvstore.namespace_info`). Keys are found with SCAN
(never KEYS, which blocks the server), in pages; a key under the prefix that fits neither name,
or holds no string, is not kvtier's: counted as foreign and never touched.

- inspect: STRLEN and OBJECT IDLETIME per entry (pipelined); Redis keeps no write time, so an
  age is the time since the entry's last access (unknown under an LFU maxmemory-policy).
- verify: GET per entry and the tiers' checks (`check_entry`, payload checksum or MAC). With
  `remove`, a bad value is deleted only if its header is still the one that failed (a Lua
  compare-and-delete), so an engine that rewrote the key since keeps its value.
- clear: UNLINK of the entries (of one namespace, or all). Namespace records stay.

Reads refresh a key's LRU position unless the server has CLIENT NO-TOUCH (Redis >= 7.2, Valkey),
which every pipeline turns on where it exists; on older servers a report says so.
With redis+cluster://, SCAN covers every primary (redis-py's cluster scan).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from kvstore.entry import HEADER_SIZE, CorruptEntry, EntryCodec
from kvtools.inspect_report import (UNKNOWN_AGE, ClearReport, NamespaceUsage, Problem, RedisTarget, Summary,
                                    TierUnavailable, Unverifiable, VerifyReport, check_entry, check_prefix)
from kvstore.namespace_info import REDIS_SUFFIX, parse_record
from kvstore.remote import connect

TIER = "G4"
SCAN_COUNT = 1000  # keys per SCAN page (a hint to the server)
STAT_BATCH = 500  # entries per STRLEN/IDLETIME pipeline
GET_BATCH = 16  # values per GET pipeline: entries are MBs
UNLINK_BATCH = 500
# Deletes KEYS[1] only if its first #ARGV[1] bytes are ARGV[1] and, for a value shorter than a
# header, its length too: the bad value verify read, not one an engine wrote since.
_DEL_IF_SAME = """
local n = string.len(ARGV[1])
if (n == tonumber(ARGV[2]) or redis.call('STRLEN', KEYS[1]) == n)
   and redis.call('GETRANGE', KEYS[1], 0, n - 1) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
_NO_TOUCH_NOTE = ("the server has no CLIENT NO-TOUCH (Redis < 7.2): reading the entries refreshed their LRU "
                  "position")


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisTool:
    """One connection to a G4 server for the `kvtier kv` commands (see the module docstring).
    Every redis error or unreachable server becomes TierUnavailable."""

    def __init__(self, target: RedisTarget, prefix: str = "kvtier", timeout_s: float = 5.0, client: Any = None) -> None:
        check_prefix(prefix)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        import redis

        self.location = target.location
        self.prefix = prefix
        self._errors = (redis.RedisError, OSError)
        self._cluster = target.url.split("://", 1)[0].endswith("+cluster")
        self._no_touch: bool | None = None if not self._cluster else False  # unknown until tried
        self._key_re = re.compile(re.escape(prefix).encode() + rb":([0-9a-f]{32}):([0-9a-f]{32}|"
                                  + REDIS_SUFFIX.encode() + rb")")
        self.foreign = 0
        try:
            self.client = client if client is not None else connect(target.url, timeout_s)
            self.client.ping()
        except self._errors as e:
            raise TierUnavailable(f"cannot reach {self.location}: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        self.client.close()

    # -- the commands -------------------------------------------------------------------------
    def inspect(self, namespace: bytes | None = None) -> Summary:
        """Entries, bytes (value lengths) and ages (idle time) per namespace, with their records."""
        usages: dict[bytes, NamespaceUsage] = {}
        entries: list[tuple[bytes, bytes]] = []  # (redis key, namespace)
        records: list[tuple[bytes, bytes]] = []
        for name, ns, key in self._scan(namespace):
            (entries if key is not None else records).append((name, ns))
            if len(entries) >= STAT_BATCH:
                self._stat(entries, usages)
                entries = []
        self._stat(entries, usages)
        for start in range(0, len(records), STAT_BATCH):
            batch = records[start:start + STAT_BATCH]
            values = self._run(lambda p, b=batch: [p.get(name) for name, _ in b])
            for (_, ns), raw in zip(batch, values):
                usage = usages.setdefault(ns, NamespaceUsage(ns.hex()))
                usage.record = None if isinstance(raw, Exception) else parse_record(raw)
        notes = self._notes()
        if any(n.ages.get(UNKNOWN_AGE) for n in usages.values()):
            notes += ("idle times are not tracked under an LFU maxmemory-policy: those ages are unknown",)
        return Summary(TIER, self.location, "last access", tuple(usages[ns] for ns in sorted(usages)),
                       foreign=self.foreign, notes=notes)

    def verify(self, codec: EntryCodec, remove: bool = False, namespace: bytes | None = None) -> VerifyReport:
        """GET and check every entry; with `remove`, delete the bad ones that are unchanged since."""
        bad: list[Problem] = []
        unverified: list[str] = []
        checked = good = 0
        batch: list[tuple[bytes, bytes, bytes]] = []
        for name, ns, key in self._scan(namespace):
            if key is None:  # a namespace record
                continue
            batch.append((name, ns, key))
            if len(batch) >= GET_BATCH:
                c, g = self._verify_batch(batch, codec, remove, bad, unverified)
                checked, good, batch = checked + c, good + g, []
        c, g = self._verify_batch(batch, codec, remove, bad, unverified)
        return VerifyReport(TIER, self.location, checked + c, good + g, tuple(bad), tuple(unverified),
                            foreign=self.foreign, notes=self._notes())

    def clear(self, namespace: bytes | None = None) -> ClearReport:
        """UNLINK every entry (of one namespace, or all); records and foreign keys stay."""
        removed = 0
        batch: list[bytes] = []
        for name, _, key in self._scan(namespace):
            if key is not None:
                batch.append(name)
            if len(batch) >= UNLINK_BATCH:
                removed += self._unlink(batch)
                batch = []
        removed += self._unlink(batch)
        return ClearReport(TIER, self.location, removed, None, foreign=self.foreign)

    # -- internals ----------------------------------------------------------------------------
    def _scan(self, only: bytes | None) -> Iterator[tuple[bytes, bytes, bytes | None]]:
        """(redis key, namespace, block key or None for a record) of every kvtier key, once each."""
        pattern = f"{_glob_escape(self.prefix)}:{'' if only is None else only.hex() + ':'}*"
        seen: set[bytes] = set()  # SCAN may return a key twice
        self.foreign = 0
        try:
            for name in self.client.scan_iter(match=pattern, count=SCAN_COUNT):
                name = bytes(name) if not isinstance(name, str) else name.encode()
                if name in seen:
                    continue
                seen.add(name)
                m = self._key_re.fullmatch(name)
                if m is None:
                    self.foreign += 1
                    continue
                key = None if m[2] == REDIS_SUFFIX.encode() else bytes.fromhex(m[2].decode())
                yield name, bytes.fromhex(m[1].decode()), key
        except self._errors as e:
            raise TierUnavailable(f"SCAN on {self.location} failed: {type(e).__name__}: {e}") from None

    def _run(self, build: Callable[[Any], Any]) -> list[Any]:
        """One pipelined round trip (CLIENT NO-TOUCH first, where the server has it); per-command
        errors come back as exceptions in the list."""
        try:
            pipe = self.client.pipeline(transaction=False)
            guard = self._no_touch is not False
            if guard:
                pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
            build(pipe)
            res = pipe.execute(raise_on_error=False)
        except self._errors as e:
            raise TierUnavailable(f"{self.location} failed: {type(e).__name__}: {e}") from None
        if guard:
            self._no_touch = not isinstance(res.pop(0), Exception)
        return res

    def _notes(self) -> tuple[str, ...]:
        return (_NO_TOUCH_NOTE,) if self._no_touch is False and not self._cluster else ()

    def _stat(self, entries: list[tuple[bytes, bytes]], usages: dict[bytes, NamespaceUsage]) -> None:
        if not entries:
            return
        # IDLETIME before STRLEN: STRLEN counts as an access where NO-TOUCH is missing.
        res = self._run(lambda p: [(p.object("IDLETIME", n), p.strlen(n)) for n, _ in entries])
        for (_, ns), idle, size in zip(entries, res[0::2], res[1::2]):
            if isinstance(size, Exception):  # WRONGTYPE: not a string, so not kvtier's
                self.foreign += 1
            elif size:  # 0: gone since the SCAN (evicted, expired)
                age = None if isinstance(idle, Exception) or idle is None else float(idle)  # LFU: not tracked
                usages.setdefault(ns, NamespaceUsage(ns.hex())).add(int(size), age)

    def _verify_batch(self, batch: list[tuple[bytes, bytes, bytes]], codec: EntryCodec, remove: bool,
                      bad: list[Problem], unverified: list[str]) -> tuple[int, int]:
        """(checked, good) of one batch; bad and unverified ones are appended."""
        if not batch:
            return 0, 0
        checked = good = 0
        values = self._run(lambda p: [p.get(name) for name, _, _ in batch])
        for (name, ns, key), raw in zip(batch, values):
            if raw is None:  # gone since the SCAN
                continue
            if isinstance(raw, Exception):  # WRONGTYPE
                self.foreign += 1
                continue
            checked += 1
            where = name.decode()
            try:
                head = check_entry(codec, raw, ns, key, len(raw))
                codec.check_payload(head, memoryview(raw)[HEADER_SIZE:])
                good += 1
            except Unverifiable as e:
                unverified.append(f"{where}: {e}")
            except CorruptEntry as e:
                bad.append(self._bad(name, bytes(raw[:HEADER_SIZE]), str(e)) if remove else Problem(where, str(e)))
        return checked, good

    def _bad(self, name: bytes, head: bytes, reason: str) -> Problem:
        res = self._run(lambda p: [p.eval(_DEL_IF_SAME, 1, name, head, HEADER_SIZE)])[0]
        if isinstance(res, Exception):
            return Problem(name.decode(), f"{reason} (cannot remove: {res})")
        if not res:
            return Problem(name.decode(), f"{reason} (rewritten or gone since it was read; left alone)")
        return Problem(name.decode(), reason, removed=True)

    def _unlink(self, names: list[bytes]) -> int:
        if not names:
            return 0
        return sum(r for r in self._run(lambda p: [p.unlink(n) for n in names]) if isinstance(r, int))

"""Turn-aware LRU: keeps the prompts of conversations likely to come back.

A conversation's next turn reuses its whole previous prompt, and a conversation that has
already come back is likelier to come back again: most end after their first turn. Plain LRU
ranks a first turn's blocks and a tenth turn's alike, so at small capacities it spends most
of its room on first turns that never return.

Each block gets a *turn level*: how many earlier requests of its session this policy has
seen (capped at `levels - 1`), from the session hint (`BlockInfo.session`). Each level keeps
its own LRU list. The policy learns each level's continuation rate online, from the
requests themselves: of the sessions that reached level l, how many came back for another
turn (counts halve every `half_life` requests, so the rates follow the traffic). A level
ages at (best rate / its rate) ** `gamma` times the speed of the best one, and `evict` takes
the oldest block of the level whose weighted age is largest. Ages are in the clock of the
requests' arrival times. Without session hints every block is level 0 and this is LRU.

insert/touch/remove/pin/unpin are O(1); evict is O(levels) per victim, plus the protected
keys it skips.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import ClassVar

from policies.base import BlockInfo, EvictionPolicy, K, check_run
from policies.pins import PinnedAside, as_lookup, check_count

_NONE = object()


class TurnLRUPolicy(PinnedAside[K], EvictionPolicy[K]):
    """Options: `levels` (int >= 1, default 4), `gamma` (float >= 0, default 1.0; 0 is LRU),
    `half_life` (requests, int >= 1, default 2000), `sessions` (sessions remembered, int >=
    1, default 65536; the least recently seen are forgotten). Priorities are ignored."""

    name: ClassVar[str] = "turn_lru"

    def __init__(self, levels: int = 4, gamma: float = 1.0, half_life: int = 2000, sessions: int = 65536) -> None:
        for opt, value, low in (("levels", levels, 1), ("half_life", half_life, 1), ("sessions", sessions, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"turn_lru option {opt!r} must be an int >= {low}; got {value!r}")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma < 64:
            raise ValueError(f"turn_lru option 'gamma' must be a number in [0, 64); got {gamma!r}")
        self._levels, self._gamma, self._half_life, self._max_sessions = levels, float(gamma), half_life, sessions
        self._lists: list[OrderedDict[K, None]] = [OrderedDict() for _ in range(levels)]  # oldest first
        self._level: dict[K, int] = {}  # every candidate, pinned ones included
        self._used: dict[K, float] = {}  # candidate -> its last use, on the arrival clock
        self._pinned: set[K] = set()
        self._sessions: OrderedDict[str, list] = OrderedDict()  # session -> [requests seen, last arrival]
        self._reached = [1.0] * levels  # requests at each level (decayed), with a prior
        self._returned = [1.0] * levels  # ... whose session came back for another
        self._weights = [1.0] * levels
        self._requests = 0
        self._now = 0.0

    @classmethod
    def from_config(cls, capacity: int | None, options: Mapping[str, object]) -> TurnLRUPolicy:
        known = {"levels", "gamma", "half_life", "sessions"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"eviction policy 'turn_lru': unknown options {unknown}; it takes {sorted(known)}")
        return cls(**options)  # type: ignore[arg-type]

    # -- turn levels ----------------------------------------------------------------------
    def _level_of(self, info: BlockInfo) -> int:
        if info.arrival > self._now:
            self._now = info.arrival
        if info.session is None:
            return 0
        entry = self._sessions.get(info.session)
        if entry is None:
            entry = self._sessions[info.session] = [0, None]
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(info.session)
        if entry[1] != info.arrival:  # a new request of this session
            entry[0] += 1
            entry[1] = info.arrival
            self._count(entry[0])
        return min(entry[0] - 1, self._levels - 1)

    def _count(self, requests: int) -> None:
        top = self._levels - 1
        self._reached[min(requests - 1, top)] += 1
        if requests > 1:
            self._returned[min(requests - 2, top)] += 1
        self._requests += 1
        if self._requests % self._half_life == 0:
            self._reached = [x / 2 for x in self._reached]
            self._returned = [x / 2 for x in self._returned]
        rates = [r / max(n, r) for r, n in zip(self._returned, self._reached)]
        best = max(rates)
        self._weights = [(best / r) ** self._gamma for r in rates]

    # -- the policy interface -------------------------------------------------------------
    def insert(self, key: K, priority: int = 0) -> None:
        self.insert_block(key, BlockInfo(arrival=self._now, priority=priority))

    def insert_block(self, key: K, info: BlockInfo) -> None:
        if key in self._level:
            raise ValueError(f"key already present: {key!r}")
        level = self._level_of(info)
        self._level[key] = level
        self._used[key] = self._now
        self._lists[level][key] = None

    def touch(self, key: K, priority: int | None = None) -> None:
        self.touch_block(key, BlockInfo(arrival=self._now, priority=priority or 0))

    def touch_block(self, key: K, info: BlockInfo) -> None:
        old = self._level[key]  # KeyError if absent
        level = max(old, self._level_of(info))  # a block shared by a later turn ranks with it
        self._used[key] = self._now
        if key in self._pinned:
            self._level[key] = level
            return
        del self._lists[old][key]
        self._level[key] = level
        self._lists[level][key] = None

    def insert_blocks(self, keys: Sequence[K], info: BlockInfo) -> None:
        check_run(self, keys, present=False)
        if not keys:
            return
        level = self._level_of(info)
        lst, levels, used, now = self._lists[level], self._level, self._used, self._now
        for key in reversed(keys):  # deepest oldest: evicted first
            levels[key] = level
            used[key] = now
            lst[key] = None

    def touch_blocks(self, keys: Sequence[K], info: BlockInfo) -> None:
        check_run(self, keys, present=True)
        if not keys:
            return
        new = self._level_of(info)
        lists, levels, used, pinned, now = self._lists, self._level, self._used, self._pinned, self._now
        for key in reversed(keys):
            old = levels[key]
            level = levels[key] = old if old > new else new
            used[key] = now
            if key not in pinned:
                del lists[old][key]
                lists[level][key] = None

    def remove(self, key: K) -> None:
        level = self._level.pop(key)
        del self._used[key]
        if key in self._pinned:
            self._pinned.remove(key)
        else:
            del self._lists[level][key]

    def _unrank(self, key: K) -> None:
        del self._lists[self._level[key]][key]

    def _rerank(self, key: K) -> None:
        self._used[key] = self._now
        self._lists[self._level[key]][key] = None

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        check_count(n)
        if n == 0:
            return []
        skip = as_lookup(protected)
        used, weights, now = self._used, self._weights, self._now
        walks = [iter(lst) for lst in self._lists]
        scores = []  # each level's oldest eligible key's weighted age; -1: none left
        for level, walk in enumerate(walks):
            head = next((k for k in walk if k not in skip), _NONE)
            scores.append(-1.0 if head is _NONE else weights[level] * (now - used[head] + 1e-9))  # type: ignore[index]
            walks[level] = itertools.chain((head,), walk)  # type: ignore[call-overload]
        victims: list[K] = []
        # Collect first, delete after: a short count must leave everything as it was. Scores
        # fall along a level's list, so the winning level keeps winning until its next key's
        # score drops below the best other head's (ties go to the lower level).
        while len(victims) < n:
            best = scores.index(max(scores))
            if scores[best] < 0:
                return None
            rival, rival_at = -1.0, len(scores)
            for c, sc in enumerate(scores):
                if c != best and sc > rival:
                    rival, rival_at = sc, c
            weight, walk = weights[best], walks[best]
            for key in walk:
                if key in skip:
                    continue
                s = weight * (now - used[key] + 1e-9)
                if len(victims) < n and (s > rival or (s == rival and best < rival_at)):
                    victims.append(key)
                    continue
                scores[best] = s
                walks[best] = itertools.chain((key,), walk)
                break
            else:
                scores[best] = -1.0
        for key in victims:
            del self._lists[self._level.pop(key)][key]
            del self._used[key]
        return victims

    def __len__(self) -> int:
        return len(self._level)

    def __contains__(self, key: object) -> bool:
        return key in self._level

    def check_integrity(self) -> None:
        ranked = {k: lvl for lvl, lst in enumerate(self._lists) for k in lst}
        self._check_pins(ranked)
        if len(ranked) + len(self._pinned) != len(self._level) or self._used.keys() != self._level.keys():
            raise RuntimeError("turn_lru: ranked + pinned keys differ from the candidates")
        if any(self._level[k] != lvl for k, lvl in ranked.items()) or any(k not in self._level for k in self._pinned):
            raise RuntimeError("turn_lru: a key is listed under the wrong level, or a pinned key is no candidate")
        if len(self._sessions) > self._max_sessions:
            raise RuntimeError("turn_lru: more sessions remembered than allowed")

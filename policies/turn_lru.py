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

insert/touch/remove/pin/unpin are O(1); evict is O(1) per victim plus O(levels) each time
the winning level changes, plus one pass over `protected` to count what may not go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import ClassVar

from policies.base import BlockInfo, EvictionPolicy, K, check_run
from policies.pins import PinnedAside, as_lookup, check_count

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
        # Per level: unpinned candidate -> its last use on the arrival clock, oldest first.
        self._lists: list[OrderedDict[K, float]] = [OrderedDict() for _ in range(levels)]
        self._level: dict[K, int] = {}  # every candidate, pinned ones included
        self._pinned: set[K] = set()
        self._sessions: OrderedDict[str, list] = OrderedDict()  # session -> [requests seen, last arrival]
        self._reached = [1.0] * levels  # requests at each level (decayed), with a prior
        self._returned = [1.0] * levels  # ... whose session came back for another
        self._weights: list[float] | None = [1.0] * levels
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
        self._weights = None  # recomputed by the next evict

    def _current_weights(self) -> list[float]:
        if self._weights is None:
            rates = [r / max(n, r) for r, n in zip(self._returned, self._reached)]
            best = max(rates)
            self._weights = [(best / r) ** self._gamma for r in rates]
        return self._weights

    # -- the policy interface -------------------------------------------------------------
    def insert(self, key: K, priority: int = 0) -> None:
        self.insert_block(key, BlockInfo(arrival=self._now, priority=priority))

    def insert_block(self, key: K, info: BlockInfo) -> None:
        if key in self._level:
            raise ValueError(f"key already present: {key!r}")
        level = self._level_of(info)
        self._level[key] = level
        self._lists[level][key] = self._now

    def touch(self, key: K, priority: int | None = None) -> None:
        self.touch_block(key, BlockInfo(arrival=self._now, priority=priority or 0))

    def touch_block(self, key: K, info: BlockInfo) -> None:
        old = self._level[key]  # KeyError if absent
        level = max(old, self._level_of(info))  # a block shared by a later turn ranks with it
        self._level[key] = level
        if key not in self._pinned:
            del self._lists[old][key]
            self._lists[level][key] = self._now

    def insert_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        if len(set(keys)) != len(keys) or not self._level.keys().isdisjoint(keys):
            check_run(self, keys, present=False)  # raises the standard error
        if not keys:
            return
        level = self._level_of(info)
        lst, levels, now = self._lists[level], self._level, self._now
        for key in reversed(keys):  # deepest oldest: evicted first
            levels[key] = level
            lst[key] = now

    def touch_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        if not all(map(self._level.__contains__, keys)):
            check_run(self, keys, present=True)  # raises the standard error
        if not keys:
            return
        new = self._level_of(info)
        lists, levels, pinned, now = self._lists, self._level, self._pinned, self._now
        for key in reversed(keys):
            old = levels[key]
            level = levels[key] = old if old > new else new
            if key not in pinned:
                del lists[old][key]
                lists[level][key] = now

    def remove(self, key: K) -> None:
        level = self._level.pop(key)
        if key in self._pinned:
            self._pinned.remove(key)
        else:
            del self._lists[level][key]

    def _unrank(self, key: K) -> None:
        del self._lists[self._level[key]][key]

    def _rerank(self, key: K) -> None:
        self._lists[self._level[key]][key] = self._now

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        check_count(n)
        if n == 0:
            return []
        skip = as_lookup(protected)
        levels, pinned = self._level, self._pinned
        # Counted first so that the walk below may pop as it goes: a short count leaves
        # everything as it was.
        if len(levels) - len(pinned) - sum(1 for k in skip if k in levels and k not in pinned) < n:
            return None
        lists, weights, now = self._lists, self._current_weights(), self._now
        aside: list[tuple[int, K, float]] = []  # protected keys popped off a head; put back after
        scores = []  # each level's oldest eligible key's weighted age; -1: none left
        for level, lst in enumerate(lists):
            score = -1.0
            while lst:
                key, used = next(iter(lst.items()))
                if key not in skip:
                    score = weights[level] * (now - used + 1e-9)
                    break
                lst.popitem(last=False)
                aside.append((level, key, used))
            scores.append(score)
        victims: list[K] = []
        left = n
        # Scores fall along a level's list, so the winning level keeps winning until its
        # next key's score drops below the best other head's (ties go to the lower level).
        while left:
            best = scores.index(max(scores))
            if scores[best] < 0:  # the count above said there were enough
                raise RuntimeError("turn_lru: ran out of eligible keys mid-eviction")
            rival, rival_at = -1.0, len(scores)
            for c, sc in enumerate(scores):
                if c != best and sc > rival:
                    rival, rival_at = sc, c
            weight, lst, wins_tie = weights[best], lists[best], best < rival_at
            scores[best] = -1.0
            while lst:
                key, used = lst.popitem(last=False)
                if key in skip:
                    aside.append((best, key, used))
                    continue
                s = weight * (now - used + 1e-9)
                if s > rival or (s == rival and wins_tie):
                    victims.append(key)
                    left -= 1
                    if left:
                        continue
                    break
                lst[key] = used  # not this one: back to the head
                lst.move_to_end(key, last=False)
                scores[best] = s
                break
        for level, key, used in reversed(aside):
            lists[level][key] = used
            lists[level].move_to_end(key, last=False)
        for key in victims:
            del levels[key]
        return victims

    def __len__(self) -> int:
        return len(self._level)

    def __contains__(self, key: object) -> bool:
        return key in self._level

    def check_integrity(self) -> None:
        ranked = {k: lvl for lvl, lst in enumerate(self._lists) for k in lst}
        self._check_pins(ranked)
        if len(ranked) + len(self._pinned) != len(self._level):
            raise RuntimeError("turn_lru: ranked + pinned keys differ from the candidates")
        if any(self._level[k] != lvl for k, lvl in ranked.items()) or any(k not in self._level for k in self._pinned):
            raise RuntimeError("turn_lru: a key is listed under the wrong level, or a pinned key is no candidate")
        if any(list(lst.values()) != sorted(lst.values()) for lst in self._lists):
            raise RuntimeError("turn_lru: a level's list is not oldest first")
        if len(self._sessions) > self._max_sessions:
            raise RuntimeError("turn_lru: more sessions remembered than allowed")

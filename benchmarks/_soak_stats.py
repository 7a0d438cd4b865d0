"""soak.py's view of /v1/kv/stats: one answer flattened to "TIER.name" counters, and those
counters summed over server restarts (each restarted server counts from zero again).

Imported by soak.py after it has put the repo root first on sys.path and benchmarks/ last.
"""
from __future__ import annotations

import threading
from typing import Any

LOWER_TIERS = ("G2", "G3", "G4")
# Counters summed over server restarts (every other field of /v1/kv/stats is a gauge).
CUM_KEYS = ("prompt_tokens", "G1.hit_tokens", "G1.queries", "offload.load_failures",
            *(f"{t}.{k}" for t in LOWER_TIERS for k in ("hit_tokens", "miss_tokens", "corrupt")),
            "G3.write_errors", "G3.bytes_written", "G3.evictions",
            "G4.outages", "G4.failed_writes", "G4.dropped_writes", "G4.written_blocks", "G4.hits", "G4.write_errors")


def flatten(st: dict[str, Any]) -> dict[str, Any]:
    """The counters of one /v1/kv/stats answer as "TIER.name" -> number (plus G4.breaker)."""
    t = st["tiers"]
    out: dict[str, Any] = {"prompt_tokens": st["requests"]["prompt_tokens"],
                           "G1.hit_tokens": t["G1"]["prefix_cache_hits"], "G1.queries": t["G1"]["prefix_cache_queries"],
                           "offload.load_failures": (st.get("offload") or {}).get("load_failures", 0)}
    for tier in LOWER_TIERS:
        for k, v in (t.get(tier) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{tier}.{k}"] = v
    if "G4" in t:
        out["G4.breaker"] = t["G4"].get("breaker")
    return out


def lower_hits(flat: dict[str, Any]) -> int:
    return sum(flat.get(f"{t}.hit_tokens", 0) for t in LOWER_TIERS)


class Counters:
    """Cumulative counters over server restarts: each incarnation's last values are folded into
    a base when the next incarnation's first sample arrives. Samples come from several threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.base: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.inc = -1
        self.series: list[tuple[float, int, dict[str, float], str | None]] = []  # (t, incarnation, cum, breaker)

    def add(self, t: float, inc: int, flat: dict[str, Any]) -> None:
        with self.lock:
            if inc < self.inc:
                return  # a late answer from a server that is gone
            if inc > self.inc:
                for k, v in self.last.items():
                    self.base[k] = self.base.get(k, 0) + v
                self.last, self.inc = {}, inc
            for k in CUM_KEYS:
                if k in flat:
                    self.last[k] = max(self.last.get(k, 0), flat[k])
            cum = {k: self.base.get(k, 0) + self.last.get(k, 0) for k in CUM_KEYS}
            self.series.append((t, inc, cum, flat.get("G4.breaker")))
            self.series.sort(key=lambda s: s[0])  # nearly sorted: cheap

    def at(self, t: float) -> dict[str, float]:
        """Cumulative counters as of the last sample taken at or before `t`."""
        with self.lock:
            best: dict[str, float] = {k: 0 for k in CUM_KEYS}
            for ts, _, cum, _ in self.series:
                if ts > t:
                    break
                best = cum
            return best

    def now(self) -> tuple[dict[str, float], str | None]:
        with self.lock:
            if not self.series:
                return {k: 0 for k in CUM_KEYS}, None
            return self.series[-1][2], self.series[-1][3]

"""The periodic stats line of `kvtier serve` (vLLM's "Avg prompt throughput ..." line, plus the
tiers): every --log-stats-interval seconds while the server is busy, from the same engine stats
snapshot /metrics and /v1/kv/stats read.

Rates are over the interval since the previous line: prompt and generation throughput, the G1
prefix-cache hit rate (hit tokens over looked-up tokens), and per offload tier the prompt tokens it
served and the bytes written into it and read out of it. Nothing is logged while the engine is idle
(no request running or waiting and no counter moved)."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from connectors.base import tier_entries
from server.logs import fields

log = logging.getLogger("kvtier.stats")
STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class _Counters:
    prompt: int
    generation: int
    queries: int
    hits: int
    preemptions: int
    tiers: tuple[tuple[str, int, int, int], ...]  # (tier, hit tokens, bytes in, bytes out)

    @classmethod
    def of(cls, s: dict[str, Any]) -> _Counters:
        tiers = tuple((name, int(t.get("hit_tokens", 0)), int(t.get("bytes_in", t.get("bytes_written", 0))),
                       int(t.get("bytes_out", t.get("bytes_read", 0))))
                      for name, t in tier_entries(s.get("tiers") or {}).items())
        return cls(s["prompt_tokens"], s["generation_tokens"], s["prefix_cache_queries"], s["prefix_cache_hits"],
                   s["num_preemptions"], tiers)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class StatsLogger:
    """Owns the previous snapshot's counters; `report` turns the next snapshot into a line."""

    def __init__(self, interval_s: float = STATS_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"--log-stats-interval must be > 0 seconds; got {interval_s}")
        self.interval_s = interval_s
        self._last: _Counters | None = None
        self._last_at = 0.0

    def report(self, snap: dict[str, Any], now: float) -> bool:
        """Logs the line for `snap` taken at `now` (seconds, monotonic); False when idle (no line)."""
        cur = _Counters.of(snap)
        last, last_at = self._last, self._last_at
        self._last, self._last_at = cur, now
        if last is None:  # the first snapshot is the baseline
            return False
        busy = snap["num_running"] or snap["num_waiting"]
        if not busy and cur == last:
            return False
        dt = max(now - last_at, 1e-9)
        queries, hits = cur.queries - last.queries, cur.hits - last.hits
        before = {t[0]: t for t in last.tiers}
        tiers = {}
        for name, hit, b_in, b_out in cur.tiers:
            _, hit0, in0, out0 = before.get(name, (name, 0, 0, 0))
            tiers[name] = {"hit_tokens": hit - hit0, "bytes_in": b_in - in0, "bytes_out": b_out - out0}
        f = {"prompt_throughput": (cur.prompt - last.prompt) / dt,
             "generation_throughput": (cur.generation - last.generation) / dt,
             "running": snap["num_running"], "waiting": snap["num_waiting"], "g1_usage": snap["kv_cache_usage"],
             "prefix_cache_hit_rate": hits / queries if queries else None,
             "preemptions": cur.preemptions - last.preemptions, "tiers": tiers, "interval_s": dt}
        rate = "-" if queries == 0 else f"{hits / queries:.1%}"
        tier_text = "".join(f", {name}: {t['hit_tokens']} hit tokens, {_mb(t['bytes_in'])} in, {_mb(t['bytes_out'])} out"
                            for name, t in tiers.items())
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                 "Waiting: %d reqs, G1 KV cache usage: %.1f%%, Prefix cache hit rate: %s, Preemptions: %d%s",
                 f["prompt_throughput"], f["generation_throughput"], f["running"], f["waiting"],
                 100 * f["g1_usage"], rate, f["preemptions"], tier_text, extra=fields(**f))
        return True


async def run_stats_log(stats: Any, ready: Any, logger: StatsLogger) -> None:
    """Every interval, `await stats()` (the engine client's) when `ready()`, and report it. Runs until
    cancelled; a snapshot that cannot be had (engine down, timeout) skips that line."""
    loop = asyncio.get_running_loop()
    while True:  # the first snapshot, at once, is the baseline the first interval is measured from
        if ready():
            try:
                snap = await stats()
            except (RuntimeError, TimeoutError) as e:  # EngineDeadError is a RuntimeError
                log.debug("no stats line: %s", e)
            else:
                logger.report(snap, loop.time())
        await asyncio.sleep(logger.interval_s)

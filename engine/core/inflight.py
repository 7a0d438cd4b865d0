"""Prompt blocks being computed right now, so a waiting request that shares them waits for them
instead of computing them a second time (the scheduler's `schedule`, prefix caching on).

A map built afresh each step: full prompt block key -> the running request that will compute
it. Bookkeeping only, no tensors; nothing here is kept between steps.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.core.request import Request
from engine.kv.kv_cache_manager import KVCacheManager
from kvstore.keys import BlockKey

Inflight = dict[BlockKey, Request]


def inflight_keys(kv: KVCacheManager, running: Iterable[Request], anyone_waiting: bool) -> Inflight:
    """Keys of the full prompt blocks running requests have still to compute, and who computes
    them (empty without prefix caching, or with nobody waiting to share them)."""
    inflight: Inflight = {}
    if not kv.pool.enable_caching or not anyone_waiting:
        return inflight
    for r in running:
        if r.num_computed_tokens < r.num_prompt_tokens:
            add_inflight(kv, inflight, r, r.num_computed_tokens)
    return inflight


def add_inflight(kv: KVCacheManager, inflight: Inflight, req: Request, num_computed: int) -> None:
    """`req`'s prompt blocks from `num_computed` on: it computes them in this step or later."""
    bs = kv.block_size
    inflight.update(dict.fromkeys(kv.prompt_keys(req)[num_computed // bs:req.num_prompt_tokens // bs], req))


def being_computed(kv: KVCacheManager, req: Request, num_hit_blocks: int, inflight: Inflight) -> Request | None:
    """Who is computing the request's next block after its hits, if a running prompt is."""
    if not inflight:
        return None
    keys = kv.prompt_keys(req)
    if num_hit_blocks < min(len(keys), (req.num_tokens - 1) // kv.block_size):
        return inflight.get(keys[num_hit_blocks])
    return None

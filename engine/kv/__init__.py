"""G1's block tables and what other engines learn of them.

`kv_cache_manager` keeps each request's block tables (one per KV group, `kv_groups`) over the G1
block pool, with prefix-cache lookups; `kv_events` publishes stores and removals as vLLM's KV
events (`kv_events_replay` serves a subscriber's gap); `fingerprint` is the model identity that
keeps one model's KV from being served to another by the persistent tiers.
"""

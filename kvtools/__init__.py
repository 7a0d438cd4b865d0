"""`kvtier kv`: the operator's tools over the offload tiers, outside the serving path.

`cli` is `kvtier kv inspect|verify|clear` on a G3 directory or a G4 URL (reports from
`inspect_disk`, `inspect_redis`, `inspect_report`); `events_cli` is `kvtier kv events`, which
follows the engines' KV events (`residency`, `residency_wire`: vLLM's msgpack wire format) into a
fleet view of which replica holds which blocks. Only kvstore is imported: these tools read the
tiers' files and records as a stranger would.
"""

"""Issue 13: any storage backend is a tier, chosen by `kv_connector_extra_config["tiers"]`.

The plugin here is the out-of-tree example (`examples/kvtier-example-backend`, one file per key),
named by `module:Class`; tests/connectors/test_plugin_install.py selects it by its entry-point
name once pip-installed. Oracle: the same prompts with offload off (offload_helpers.reference).
A restart (a new LLM on the same store) is what flushes G1 and G2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_helpers import KIND, check_integrity, hit_tokens, offload_llm, reference, run, tokens, workload

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvtier-example-backend"
PLUGIN = "kvtier_example_backend:DirBackend"
PROMPTS = workload()


@pytest.fixture(autouse=True)
def example_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


@pytest.fixture(scope="module")
def model_dir(ckpt_dir):
    return ckpt_dir(KIND)


def stack_llm(model_dir, tiers: list[dict], **kw):
    tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {"tiers": tiers}}
    return offload_llm(model_dir, kv_transfer_config=tc, **kw)


def plugin_tier(root: Path, **opts) -> dict:
    return {"backend": PLUGIN, "root": str(root), **opts}


def test_plugin_backend_serves_hits_after_a_restart(model_dir, tmp_path):
    ref = reference(model_dir, PROMPTS)
    tiers = [{"backend": "host", "size_gib": 0.05}, plugin_tier(tmp_path / "store")]
    llm = stack_llm(model_dir, tiers)
    try:
        assert tokens(run(llm, PROMPTS)) == ref
        llm.engine.connector.flush()
        written = llm.get_stats().tiers["G3"]
        assert written["backend"] == PLUGIN and written["bytes_written"] > 0
    finally:
        llm.close()
    assert list((tmp_path / "store").glob("*.blk")), "nothing reached the plugin's store"
    llm = stack_llm(model_dir, tiers)  # G1 and G2 empty: everything below G1 comes from the plugin
    try:
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref
        assert [o.cached_tokens_by_tier.get("G3", 0) for o in outs] == [hit_tokens(len(p)) for p in PROMPTS]
        g3 = llm.get_stats().tiers["G3"]
        assert g3["hit_tokens"] == sum(hit_tokens(len(p)) for p in PROMPTS) and g3["hits"] > 0
        assert g3["corrupt"] == 0
        check_integrity(llm)
    finally:
        llm.close()


def test_plugin_tier_alone_and_below_other_tiers(model_dir, tmp_path):
    """The plugin as the only tier; as a batched tier (reuse-gated batched writes) below the
    built-in disk; and third, below the disk and another parallel plugin tier. The tiers above
    it are emptied before the second engine starts, so its hits must come from the plugin."""
    ref = reference(model_dir, PROMPTS)
    disk = {"backend": "disk", "path": str(tmp_path / "d"), "size_gib": 0.5}
    cases = (([plugin_tier(tmp_path / "a")], "G3", []),
             ([disk, plugin_tier(tmp_path / "b", mode="batched", min_uses=1)], "G4", [tmp_path / "d"]),
             ([disk, plugin_tier(tmp_path / "c1"), plugin_tier(tmp_path / "c2", mode="batched")], "G5",
              [tmp_path / "d", tmp_path / "c1"]))
    for tiers, name, wipe in cases:
        llm = stack_llm(model_dir, tiers)
        try:
            assert tokens(run(llm, PROMPTS)) == ref
            llm.engine.connector.flush()
        finally:
            llm.close()
        for root in wipe:
            for f in root.rglob("*"):
                if f.is_file():
                    f.unlink()
        llm = stack_llm(model_dir, tiers)
        try:
            outs = run(llm, PROMPTS)
            assert tokens(outs) == ref
            by_tier = [dict(o.cached_tokens_by_tier) for o in outs]
            assert sum(t.get(name, 0) for t in by_tier) == sum(hit_tokens(len(p)) for p in PROMPTS), by_tier
            stats = llm.get_stats().tiers
            assert stats[name]["backend"] == PLUGIN and stats[name]["hit_tokens"] > 0
            check_integrity(llm)
        finally:
            llm.close()


def test_foreign_and_damaged_entries_in_a_plugin_store_are_never_served(model_dir, tmp_path):
    ref = reference(model_dir, PROMPTS)
    store = tmp_path / "store"
    llm = stack_llm(model_dir, [plugin_tier(store)], kv_namespace="model-a")
    try:
        run(llm, PROMPTS)
        llm.engine.connector.flush()
    finally:
        llm.close()
    # Another model name on the same store: its keys differ, so nothing of model-a's is found.
    llm = stack_llm(model_dir, [plugin_tier(store)], kv_namespace="model-b")
    try:
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref and all(o.cached_tokens_by_tier.get("G3", 0) == 0 for o in outs)
    finally:
        llm.close()
    # Damage every one of model-a's entries: each read is rejected, counted and deleted.
    files = sorted(store.glob("*.blk"))
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    llm = stack_llm(model_dir, [plugin_tier(store)], kv_namespace="model-a")
    try:
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref and all(o.cached_tokens_by_tier.get("G3", 0) == 0 for o in outs)
        assert llm.get_stats().tiers["G3"]["corrupt"] >= len(PROMPTS)  # each prompt's first block at least
    finally:
        llm.close()


BAD_STACKS = [
    ({"tiers": [plugin_tier(Path("/tmp/x"))], "g3_timeout_s": 1}, "g3_timeout_s"),
    ({"tierz": []}, "tierz"),
    ({"tiers": [{"backend": "no-such-backend"}]}, "no-such-backend"),
    ({"tiers": [{"backend": "no-such-backend"}]}, "memory"),  # the error lists what exists, built-ins included
    ({"tiers": [{"backend": PLUGIN, "rot": "/tmp/x"}]}, "rot"),
    ({"tiers": [{"backend": "disk", "path": "/tmp/x", "sizegib": 1}]}, "sizegib"),
    ({"tiers": [{"backend": "disk"}]}, "path"),
    ({"tiers": [{"backend": "host"}]}, "size_gib"),
    ({"tiers": [plugin_tier(Path("/tmp/x")), {"backend": "host", "size_gib": 1}]}, "first entry"),
    ({"tiers": [plugin_tier(Path("/tmp/x"), min_uses=0)]}, "min_uses"),  # both modes take min_uses (admission)
    ({"tiers": [plugin_tier(Path("/tmp/x"), mode="batched", read_threads=2)]}, "read_threads.*parallel"),
    ({"tiers": [plugin_tier(Path("/tmp/x"), mode="fast")]}, "mode"),
    ({"tiers": [plugin_tier(Path(f"/tmp/{i}")) for i in range(7)]}, "at most 6"),
    ({"tiers": []}, "non-empty"),
    ({"tiers": [{"size_gib": 1}]}, "backend"),
    # Eviction policies (issue 18): built once up front, the message naming the tier and the policy.
    ({"tiers": [{"backend": "host", "size_gib": 1, "eviction_policy": "nope"}]},
     "'host' tier's eviction_policy: unknown eviction policy 'nope'"),
    ({"tiers": [{"backend": "disk", "path": "/tmp/x", "eviction_policy": {"name": "lru", "options": {"k": 1}}}]},
     "'disk' tier's eviction_policy: eviction policy 'lru' takes no options"),
    ({"tiers": [{"backend": "disk", "path": "/tmp/x", "eviction_policy": '{"name": "lru", "opts": 1}'}]},
     "unknown key.*'opts'"),
    ({"tiers": [{"backend": "redis", "url": "redis://localhost:1", "eviction_policy": "lru"}]},
     "'redis' tier's eviction_policy: G4 .* maxmemory-policy"),
    ({"g4_eviction_policy": "lru"}, "g4_eviction_policy: G4 .*allkeys-lfu"),
]


@pytest.mark.parametrize("extra,named", BAD_STACKS)
def test_bad_stack_config_fails_at_start_naming_it(model_dir, extra, named):
    tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": extra}
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        offload_llm(model_dir, kv_transfer_config=tc)


def test_flat_extra_keys_are_checked_too(model_dir, tmp_path):
    tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {"g3_backend": "sqlite"}}
    with pytest.raises(ValueError, match="g3_backend"):
        offload_llm(model_dir, kv_offload_disk=str(tmp_path / "d"), kv_transfer_config=tc)
    # Extra config with no connector and no tier to apply it to is not silently dropped.
    with pytest.raises(ValueError, match="'backend'"):
        offload_llm(model_dir, kv_transfer_config={"kv_connector_extra_config": {"backend": "sqlite"}})
    with pytest.raises(ValueError, match="no kv_connector"):
        offload_llm(model_dir, kv_transfer_config={"kv_connector_extra_config": {"write_policy": "write_back"}})
    # Per-tier policies are checked up front, in both forms, naming the key.
    for policy, named in (("lfu-ish", "g3_eviction_policy: unknown eviction policy 'lfu-ish'"),
                          ({"name": "priority", "options": {"depth": 1}}, "g3_eviction_policy: .*'priority' takes no"),
                          ('{"name": "lru"', "g3_eviction_policy: .*not valid JSON")):
        tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {"g3_eviction_policy": policy}}
        with pytest.raises(ValueError, match=named):
            offload_llm(model_dir, kv_offload_disk=str(tmp_path / "d"), kv_transfer_config=tc)
    # A flat key tuning a tier the flags did not set up would be ignored: refused, naming it.
    tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {"g4_min_uses": 2}}
    with pytest.raises(ValueError, match="g4_min_uses.*kv_offload_remote"):
        offload_llm(model_dir, kv_offload_disk=str(tmp_path / "d"), kv_transfer_config=tc)
    # The explicit stack and the tier flags are two sources for one thing: refused together.
    tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {"tiers": [plugin_tier(tmp_path)]}}
    with pytest.raises(ValueError, match="not both"):
        offload_llm(model_dir, kv_offloading_size=0.05, kv_transfer_config=tc)


@pytest.mark.parametrize("key,value,remote", [
    ("g3_io_mib", "lots", False), ("g3_read_threads", 2.5, False), ("g3_timeout_s", "soon", False),
    ("g3_min_uses", True, False), ("g4_timeout_s", [1], True), ("g4_min_uses", "twice", True)])
def test_a_flat_key_that_is_not_a_number_is_refused_naming_it(model_dir, tmp_path, key, value, remote):
    tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {key: value}}
    where = {"kv_offload_remote": "redis://127.0.0.1:1", "kv_offload_remote_trusted": True} if remote else {
        "kv_offload_disk": str(tmp_path / "d")}
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['{key}'\] must be an? (integer|number)"):
        offload_llm(model_dir, kv_transfer_config=tc, **where)


def test_tiers_take_their_own_eviction_policies(model_dir, tmp_path):
    """Issue 18: G2 and G3 each get the policy their tier entry names (mapping or JSON form),
    whatever G1's is."""
    from policies import LRUPolicy, PriorityPolicy

    tiers = [{"backend": "host", "size_gib": 0.05, "eviction_policy": {"name": "priority"}},
             {"backend": "disk", "path": str(tmp_path / "d"), "eviction_policy": '{"name": "lru", "options": {}}'}]
    llm = stack_llm(model_dir, tiers, kv_eviction_policy='{"name": "priority"}')
    try:
        conn = llm.engine.connector
        assert type(llm.engine.pool.policy) is PriorityPolicy
        assert type(conn.g2.policy) is PriorityPolicy
        assert type(conn.tier("G3").backend._policy) is LRUPolicy
    finally:
        llm.close()


def test_bad_backend_option_value_is_a_start_up_error(model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="rejected its options"):
        stack_llm(model_dir, [plugin_tier(blocker / "store")])


def test_serve_refuses_a_bad_stack_before_starting(model_dir, tmp_path):
    """`kvtier serve --kv-transfer-config` with a bad stack exits 2 naming the problem, before it
    spawns the engine (the check needs no weights)."""
    repo = Path(__file__).resolve().parents[2]
    for extra, named in ((({"tiers": [{"backend": "no-such-backend"}]}), "no-such-backend"),
                         ({"tiers": [{"backend": PLUGIN, "rot": "x"}]}, "rot"),
                         ({"tiers": [{"backend": "host", "size_gib": 1, "eviction_policy": {"name": "nope"}}]}, "'nope'"),
                         ({"tiers": [{"backend": "redis", "url": "redis://localhost:1", "eviction_policy": "lru"}]},
                          "maxmemory-policy"),
                         ({"bogus_key": 1}, "bogus_key")):
        tc = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": extra}
        proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(model_dir), "--port", "0",
                               "--kv-transfer-config", json.dumps(tc)], cwd=repo, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": f"{repo}:{EXAMPLE}"})
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
        assert named in proc.stderr

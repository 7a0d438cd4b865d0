"""Issue 43, acceptance 3: G3 files hold runs of blocks (default settings), and a prefix still hits at
G1-block granularity inside a file, reading only the blocks it needs; a damaged block inside a
file ends the hit at that block; a new engine reuses such files. Oracle: the engine with offload
and prefix caching off (offload_helpers.reference), equal to transformers' tokens."""
from __future__ import annotations

from pathlib import Path

from checkpoints import random_prompt
from connectors.codec import HEADER_BYTES
from kvstore.entry import HEADER_SIZE, decode_header, entry_length
from kvstore.keys import chain_keys
from offload_helpers import load_kinds, offload_llm, reference, run, tokens

BLOCK = 16  # G1's block size, and the offload block here: hits at G1-block granularity
BASE = random_prompt(16 * BLOCK + 4, 7201)
SHARED = (1, 5, 11, 16)  # blocks a prompt shares with BASE: boundaries inside a file and its end


def locate(disk: Path, key: bytes) -> tuple[Path, int]:
    """The G3 file holding `key`'s entry, and the entry's offset in it (walking the headers)."""
    for path in disk.rglob("*.kvb"):
        raw, offset = path.read_bytes(), 0
        while offset < len(raw):
            if decode_header(raw[offset:offset + HEADER_SIZE]).key == key:
                return path, offset
            offset += entry_length(raw[offset:offset + HEADER_SIZE])  # type: ignore[operator]
    raise AssertionError(f"no entry for {key.hex()}")


def fresh(model_dir, disk: Path):
    return offload_llm(model_dir, kv_offload_disk=str(disk), kv_offload_block_size=BLOCK)


def test_block_hits_inside_files_partial_reads_damage_and_restart(model_dir, tmp_path):
    disk = tmp_path / "g3"
    prompts = [BASE[:m * BLOCK] + random_prompt(40, 7300 + m) for m in SHARED]
    ref = reference(model_dir, [BASE, *prompts])
    first = fresh(model_dir, disk)
    try:
        assert tokens(run(first, [BASE])) == ref[:1]
        first.engine.connector.flush()
        entry_bytes = first.engine.connector.layout.encoded_bytes
    finally:
        first.close()
    files = list(disk.rglob("*.kvb"))
    assert len(files) < 16, "the prompt's 16 blocks should share files"

    again = fresh(model_dir, disk)  # a restart: served from the files the first engine wrote
    try:
        g3 = again.engine.connector.tier("G3").backend
        for m, prompt, want in zip(SHARED, prompts, ref[1:]):
            read_before = g3.stats.bytes_read
            outs = run(again, [prompt])
            assert tokens(outs) == [want]
            assert load_kinds(outs) == [{"G3": m * BLOCK}], m  # every block boundary, inside a file too
            assert g3.stats.bytes_read - read_before == m * entry_bytes  # only the blocks it needed
            again.engine.pool.reset_prefix_cache()  # the next prompt finds nothing in G1
        g3.check_integrity()
    finally:
        again.close()

    # The damaged block is the first one that sits inside a file, after another block. Which block
    # that is depends on how the store thread's batches fell (files gather one put each), so it is
    # read from the files rather than fixed; fewer files than blocks means one exists.
    found = [(d, *locate(disk, key)) for d, key in enumerate(chain_keys(BASE, BLOCK)) if d < 16]
    inside = [(d, path, offset) for d, path, offset in found if offset > 0]
    assert inside, "some block should sit inside a file, after another block"
    damaged, path, offset = inside[0]
    assert damaged >= 1
    raw = bytearray(path.read_bytes())
    raw[offset + HEADER_SIZE + HEADER_BYTES + 4 * 100 + 3] ^= 0x40  # a float's exponent bit
    path.write_bytes(bytes(raw))
    third = fresh(model_dir, disk)
    try:
        outs = run(third, [BASE])
        assert tokens(outs) == ref[:1]
        assert load_kinds(outs) == [{"G3": damaged * BLOCK}]  # the hit ends at the damaged block
        stats = third.get_stats().tiers["G3"]
        assert stats["corrupt"] == 1
        third.engine.connector.flush()
        third.engine.connector.tier("G3").backend.check_integrity()
    finally:
        third.close()

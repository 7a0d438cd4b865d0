"""A hit's last offload block is not written again (connectors/offload_planner.py `_loaded_tail`).

A prompt of a whole number of offload blocks hits one token short: its last block is loaded whole
and its last token recomputed over the copy, which completes that block again. It used to be
stored again on every repeat (a G3 file a time). Oracles: G3's own count of payload bytes
written, transformers' tokens, and, for the one case where the write is wanted (the tier's copy
was damaged and dropped), the same count showing exactly one block written.
"""
from __future__ import annotations

from checkpoints import random_prompt
from offload_helpers import OB, check_integrity, encoded_block_bytes, load_kinds, offload_llm, reference, run, tokens
from test_offload_corruption import PER_ENTRY_FILES, entry_path, flip_kv_byte

PROMPT = random_prompt(10 * OB, 7301)  # whole blocks: the hit is 10 * OB - 1 tokens
LAST = 9


def _written(llm) -> int:
    llm.engine.connector.flush()
    return llm.engine.connector.tier("G3").backend.stats.bytes_written


def _pass(model_dir, disk, **kw) -> tuple[list, int]:
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **kw)
    try:
        outs = run(llm, [PROMPT])
        written = _written(llm)
        check_integrity(llm)
        return outs, written
    finally:
        llm.close()


def test_a_repeated_prompt_is_served_from_g3_without_writing_it_again(model_dir, tmp_path):
    disk, ref = tmp_path / "g3", reference(model_dir, [PROMPT])
    payload = encoded_block_bytes(model_dir)  # what bytes_written counts per block (past G3's own header)
    outs, written = _pass(model_dir, disk)
    assert tokens(outs) == ref and written == 10 * payload
    for _ in range(2):
        outs, written = _pass(model_dir, disk)
        assert tokens(outs) == ref
        assert load_kinds(outs) == [{"G3": 10 * OB - 1}]
        assert written == 0, f"{written} bytes rewritten ({written / payload:g} blocks)"


def test_a_damaged_last_block_is_recomputed_and_written_anew(model_dir, tmp_path):
    disk, ref = tmp_path / "g3", reference(model_dir, [PROMPT])
    payload = encoded_block_bytes(model_dir)
    _pass(model_dir, disk, **PER_ENTRY_FILES)
    flip_kv_byte(entry_path(disk, PROMPT, LAST))  # caught only when read
    outs, written = _pass(model_dir, disk, **PER_ENTRY_FILES)
    assert tokens(outs) == ref
    assert load_kinds(outs) == [{"G3": LAST * OB}]
    assert written == payload  # the dropped block, once; nothing else
    outs, written = _pass(model_dir, disk, **PER_ENTRY_FILES)
    assert tokens(outs) == ref and load_kinds(outs) == [{"G3": 10 * OB - 1}] and written == 0

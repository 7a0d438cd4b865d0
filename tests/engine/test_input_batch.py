"""The persistent input batch against a plain-dict reference of the block tables it mirrors."""
from __future__ import annotations

import random

import pytest
import torch

from engine.runner.input_batch import InputBatch


def test_random_operations_match_a_dict_reference():
    rng = random.Random(0)
    batch = InputBatch(max_rows=4, max_blocks=32, device="cpu")
    tables: dict[str, list[int]] = {}  # what KVCacheManager holds: one list per request, only extended
    for step in range(2000):
        op = rng.random()
        rid = f"r{rng.randrange(8)}"
        if op < 0.15:  # finished or preempted: the scheduler side drops the list
            tables.pop(rid, None)
            batch.release(rid)
        elif op < 0.25 and rid in tables:  # freed and allocated again: a new list, maybe the same first ids
            old = tables[rid]
            tables[rid] = old[:1] + [rng.randrange(1000) for _ in range(rng.randrange(3))]
        else:
            table = tables.setdefault(rid, [])
            table.extend(rng.randrange(1000) for _ in range(rng.choice([0, 0, 1, 3])))
            if len(table) > 32:
                continue
            row = batch.sync(rid, table)
            assert batch.block_table[row, : len(table)].tolist() == table, step
        batch.check_integrity()
    assert batch.request_ids() <= set(tables)
    assert batch.block_table.shape[0] >= 8  # grew past its 4 rows instead of failing a step


def test_only_new_blocks_are_written(monkeypatch):
    batch = InputBatch(max_rows=2, max_blocks=8, device="cpu")
    table = [5, 6]
    batch.sync("a", table)
    writes = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, **kw: writes.append(list(data)) or real(data, **kw))
    batch.sync("a", table)  # unchanged: nothing written
    table.append(7)
    batch.sync("a", table)
    assert writes == [[7]]


def test_a_table_too_long_for_a_row_is_a_clear_error():
    batch = InputBatch(max_rows=1, max_blocks=2, device="cpu")
    with pytest.raises(ValueError, match="exceed"):
        batch.sync("a", [1, 2, 3])

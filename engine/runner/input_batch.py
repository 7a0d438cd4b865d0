"""Worker side: the running requests' block tables as rows of one persistent tensor.

Model Runner V2's idea: a request's row is written once when it is first scheduled and then only
where its table grew (a decode adds a block every `block_size` tokens), so a step's slot mapping
and decode tables come from tensor indexing instead of Python lists rebuilt every step.

A row belongs to the table *list* the scheduler side handed over (`KVCacheManager` keeps one list
per request and only ever extends it; freeing pops it, and a resumed request gets a new list). The
batch holds a reference to that list, so identity tells a grown table (extend the row) from a
replaced one (rewrite it) with no callback from the scheduler side.
"""
from __future__ import annotations

import torch

from engine.core.request import RequestId
from engine.runner.h2d import to_device


class InputBatch:
    def __init__(self, max_rows: int, max_blocks: int, device: str | torch.device) -> None:
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"max_rows and max_blocks must be >= 1; got {max_rows}, {max_blocks}")
        self.block_table = torch.zeros(max_rows, max_blocks, dtype=torch.long, device=device)
        self._row: dict[RequestId, int] = {}
        self._owner: list[list[int] | None] = [None] * max_rows  # the table list each row mirrors
        self._written: list[int] = [0] * max_rows  # leading entries of the row that are current
        self._free = list(range(max_rows - 1, -1, -1))

    def sync(self, req_id: RequestId, table: list[int]) -> int:
        """The request's row, brought up to date with `table`; writes only what changed."""
        row = self._row.get(req_id)
        if row is None:
            row = self._row[req_id] = self._take_row()
        if self._owner[row] is not table:  # first sight, or freed and allocated anew
            self._owner[row], self._written[row] = table, 0
        done, n = self._written[row], len(table)
        if n > self.block_table.shape[1]:
            raise ValueError(f"request {req_id}: {n} blocks exceed the batch's {self.block_table.shape[1]} a row")
        if n > done:
            self.block_table[row, done:n] = to_device(table[done:n], self.block_table.device)
            self._written[row] = n
        return row

    def release(self, req_id: RequestId) -> None:
        """Frees the request's row (it finished or was preempted); unknown ids are ignored."""
        row = self._row.pop(req_id, None)
        if row is not None:
            self._owner[row], self._written[row] = None, 0
            self._free.append(row)

    def _take_row(self) -> int:
        if not self._free:  # more requests in flight than expected: grow rather than fail a step
            old = self.block_table
            self.block_table = torch.zeros(2 * old.shape[0], old.shape[1], dtype=old.dtype, device=old.device)
            self.block_table[: old.shape[0]] = old
            self._free = list(range(2 * old.shape[0] - 1, old.shape[0] - 1, -1))
            self._owner += [None] * old.shape[0]
            self._written += [0] * old.shape[0]
        return self._free.pop()

    def request_ids(self) -> set[RequestId]:
        return set(self._row)

    def check_integrity(self) -> None:
        rows = list(self._row.values())
        if len(set(rows)) != len(rows):
            raise RuntimeError("two requests share an input-batch row")
        if set(rows) & set(self._free) or len(rows) + len(self._free) != self.block_table.shape[0]:
            raise RuntimeError("input-batch rows are lost or both used and free")
        for req_id, row in self._row.items():
            table, n = self._owner[row], self._written[row]
            if table is None or n > len(table) or self.block_table[row, :n].tolist() != table[:n]:
                raise RuntimeError(f"request {req_id}: its input-batch row differs from its block table")

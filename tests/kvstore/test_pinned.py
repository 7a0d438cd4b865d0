"""G2's slab layout: the spans it page-locks, against a brute-force reference (the locking itself
is in tests/gpu)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from kvstore.pinned import PAGE, HostSlab, register_spans


def _reference(num_rows: int, row_bytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """Greedy: from each start, the most rows that keep the span page-sized and within max_bytes
    (at least the fewest rows that make whole pages)."""
    spans, row = [], 0
    smallest = next(n for n in range(1, PAGE + 1) if n * row_bytes % PAGE == 0)
    while row < num_rows:
        best = smallest
        for n in range(smallest, num_rows + smallest + 1, smallest):
            if n * row_bytes <= max_bytes:
                best = n
        take = min(best, num_rows - row)
        spans.append((row, take))
        row += take
    return spans


@settings(max_examples=200, deadline=None)
@given(num_rows=st.integers(1, 3000), row_bytes=st.integers(1, 70_000), max_bytes=st.integers(1, 2**24))
def test_spans_match_the_reference_and_never_share_a_page(num_rows, row_bytes, max_bytes):
    spans = register_spans(num_rows, row_bytes, max_bytes, PAGE)
    assert spans == _reference(num_rows, row_bytes, max_bytes)
    assert [r for r, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(len(spans))]
    assert sum(n for _, n in spans) == num_rows
    for first, rows in spans:
        assert first * row_bytes % PAGE == 0  # every span starts on a page: none overlaps the last
        group = PAGE // math.gcd(row_bytes, PAGE)
        assert rows * row_bytes <= max_bytes or rows <= group


def test_bad_shapes_are_refused():
    for args in ((0, 10, 100), (10, 0, 100), (10, 10, 0)):
        with pytest.raises(ValueError, match="bad slab shape"):
            register_spans(*args)


def test_unpinned_slab_is_page_aligned_and_writable():
    slab = HostSlab(7, 12_345, pin=False)
    assert slab.tensor.shape == (7, 12_345) and slab.tensor.data_ptr() % PAGE == 0
    slab.tensor[6].fill_(3)
    assert int(slab.tensor[6].sum()) == 3 * 12_345 and slab.pinned_spans == []


def test_span_of_follows_the_spans_even_unpinned():
    slab = HostSlab(40, 3 * 4096, pin=False, max_register_bytes=100_000)  # 8 rows a span
    spans = register_spans(40, 3 * 4096, 100_000)
    assert [slab.span_of(r) for r in range(40)] == [i for i, (_, n) in enumerate(spans) for _ in range(n)]

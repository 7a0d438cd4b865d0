"""Conformance kit for storage backends (`connectors.backend.StorageBackend`).

Point pytest at your class from your own test file:

    from connectors.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        def make_backend(self, tmp_path):
            return MyBackend(root=tmp_path / "store")

then run `pytest`. Every check is a test method whose failure message names the broken
part of the contract ("stale value", "wrong bytes", "data lost without reporting", ...).

`make_backend(tmp_path)` must return a fresh, empty backend with room for at least 16 MiB
without evicting: the kit treats a value that vanishes while well under that as lost data.
The class attributes (`large_block_bytes`, `threads`, `ops_per_thread`,
`concurrency_timeout_s`) can be overridden; to skip a check, set it to None in the subclass
(`test_many_keys_not_lost = None`) and say why.

Decisions the kit enforces (see `StorageBackend` for the whole contract):
- zero-length payloads are valid and must round-trip as `b""` (distinct from a miss);
- `get` returns `bytes`; `put` returns one bool per key; results keep the keys' order;
- `put` copies the caller's buffers before returning;
- bad keys (not 16 `bytes`) and bad blocks raise TypeError/ValueError and store nothing;
- under concurrent put/get/delete/get_into, every answer is a miss or exactly a value
  some `put` stored for that key.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from connectors.backend import BackendError, Scatter, ScatterBatch, ScatterReads, StorageBackend
from connectors.conformance_base import _check_result, _expect_raises, _what_is_wrong, key_of, value_of
from connectors.conformance_threads import ConcurrencyChecks
from kvstore.keys import BlockKey
from policies import BlockInfo

__all__ = ["BackendConformance", "key_of", "value_of"]


class BackendConformance(ConcurrencyChecks):
    """Mix into a `Test...` class and implement `make_backend(tmp_path)`. The single-threaded
    checks are here, the concurrent ones in `conformance_threads.ConcurrencyChecks`."""

    # ---- round trips -----------------------------------------------------------------

    def test_round_trip_sizes(self, backend: StorageBackend) -> None:
        sizes = [0, 1, 19, 4096, 65_537, self.large_block_bytes]
        keys = [key_of(f"round-trip/{s}") for s in sizes]
        values = [value_of(k, 0, s) for k, s in zip(keys, sizes)]
        self._put_ok(backend, keys, values, "blocks")
        got = backend.get(keys)
        _check_result(got, len(keys), "get", (bytes, type(None)))
        for size, value, g in zip(sizes, values, got):
            problem = _what_is_wrong(g, value)
            assert problem is None, f"get of a {size}-byte block {problem}"
        assert backend.exists(keys) == [True] * len(keys), "exists is False for keys just stored"

    def test_put_accepts_buffers_and_copies_them(self, backend: StorageBackend) -> None:
        k1, k2 = key_of("buffers/1"), key_of("buffers/2")
        buf1, buf2 = bytearray(value_of(k1, 0, 4096)), bytearray(value_of(k2, 0, 3000))
        want1, want2 = bytes(buf1), bytes(buf2)
        self._put_ok(backend, [k1, k2], [memoryview(buf1), buf2], "a memoryview and a bytearray")
        buf1[:] = b"\xff" * len(buf1)  # callers reuse their buffers as soon as put returns
        buf2[:] = b"\xee" * len(buf2)
        got = backend.get([k1, k2])
        assert got[0] != bytes(buf1) and got[1] != bytes(buf2), (
            "put kept a reference to the caller's buffer instead of copying it: "
            "the stored value changed when the caller reused its buffer"
        )
        self._expect(backend, k1, want1, "a block put from a memoryview")
        self._expect(backend, k2, want2, "a block put from a bytearray")

    def test_batch_order_and_repeats(self, backend: StorageBackend) -> None:
        keys = [key_of(f"batch/{i}") for i in range(6)]
        values = [value_of(k, 0, 100 + 37 * i) for i, k in enumerate(keys)]
        self._put_ok(backend, keys, values, "a batch of blocks")
        unknown = key_of("batch/unknown")
        order = [keys[4], keys[0], unknown, keys[4], keys[5], keys[2]]
        want = [values[4], values[0], None, values[4], values[5], values[2]]
        got = backend.get(order)
        _check_result(got, len(order), "get", (bytes, type(None)))
        for i, (g, w) in enumerate(zip(got, want)):
            if w is None:
                assert g is None, f"get of an unknown key at batch position {i} returned {type(g).__name__}, not None"
            else:
                problem = _what_is_wrong(g, w, others=tuple(values))
                assert problem is None, f"get at batch position {i} {problem} (results out of order?)"
        exists = backend.exists(order)
        _check_result(exists, len(order), "exists", bool)
        assert exists == [w is not None for w in want], f"exists gave {exists} for a batch with one unknown key"

    def test_many_keys_not_lost(self, backend: StorageBackend) -> None:
        keys = [key_of(f"many/{i}") for i in range(300)]
        values = [value_of(k, 0, 1000 + i) for i, k in enumerate(keys)]
        for i in range(0, len(keys), 30):
            self._put_ok(backend, keys[i : i + 30], values[i : i + 30], "blocks")
        got = backend.get(keys)
        _check_result(got, len(keys), "get", (bytes, type(None)))
        for i, (g, v) in enumerate(zip(got, values)):
            problem = _what_is_wrong(g, v, others=tuple(values))
            assert problem is None, f"get of key {i} of 300 {problem}"

    def test_keys_differing_in_one_byte_are_distinct(self, backend: StorageBackend) -> None:
        """Keys are 16 opaque bytes: one that differs from another in any single byte (first,
        middle or last) is another key. Catches storage under a truncated or weakly hashed key."""
        base = key_of("one-byte")
        keys = [base] + [BlockKey(base[:i] + bytes([base[i] ^ 0x01]) + base[i + 1:]) for i in (0, 7, 8, 15)]
        values = [value_of(k, 0, 600 + i) for i, k in enumerate(keys)]
        self._put_ok(backend, keys, values, "blocks under keys one byte apart")
        got = backend.get(keys)
        _check_result(got, len(keys), "get", (bytes, type(None)))
        for i, (g, v) in enumerate(zip(got, values)):
            problem = _what_is_wrong(g, v, others=tuple(values))
            where = "the base key" if i == 0 else f"a key differing from it only in byte {(0, 7, 8, 15)[i - 1]}"
            assert problem is None, f"get of {where} {problem}: are keys truncated or hashed into buckets?"

    # ---- misses, exists, overwrite, delete -------------------------------------------

    def test_unknown_keys_miss(self, backend: StorageBackend) -> None:
        keys = [key_of(f"unknown/{i}") for i in range(3)]
        got = backend.get(keys)
        _check_result(got, 3, "get", (bytes, type(None)))
        assert got == [None] * 3, f"get of unknown keys must return None (a miss) for each, got {got!r:.200}"
        exists = backend.exists(keys)
        _check_result(exists, 3, "exists", bool)
        assert exists == [False] * 3, f"exists of unknown keys must be False, got {exists}"
        filled = backend.get_into(keys, [bytearray(10) for _ in keys])
        _check_result(filled, 3, "get_into", bool)
        assert filled == [False] * 3, f"get_into of unknown keys must be False, got {filled}"

    def test_empty_batches(self, backend: StorageBackend) -> None:
        assert backend.get([]) == [], "get([]) must return []"
        assert backend.exists([]) == [], "exists([]) must return []"
        assert backend.put([], []) == [], "put([], []) must return []"
        assert backend.get_into([], []) == [], "get_into([], []) must return []"
        backend.delete([])

    def test_overwrite_latest_wins(self, backend: StorageBackend) -> None:
        k = key_of("overwrite")
        versions = [value_of(k, v, size) for v, size in enumerate([1000, 2500, 10, 2500])]
        for i, value in enumerate(versions):
            self._put_ok(backend, [k], [value], "an overwrite")
            self._expect(backend, k, value, f"a key after overwrite #{i}" if i else "a key", earlier=tuple(versions[:i]))
        buf = bytearray(2500)
        assert backend.get_into([k], [buf]) == [True], "get_into of an overwritten key failed"
        assert bytes(buf) == versions[-1], "get_into of an overwritten key returned a stale or wrong value"

    def test_delete(self, backend: StorageBackend) -> None:
        a, b, unknown = key_of("delete/a"), key_of("delete/b"), key_of("delete/unknown")
        va, vb = value_of(a, 0, 3000), value_of(b, 0, 3000)
        self._put_ok(backend, [a, b], [va, vb], "blocks")
        assert backend.delete([a]) is None, "delete must return None"
        assert backend.get([a]) == [None], "get after delete must miss, but the deleted value was returned"
        assert backend.exists([a]) == [False], "exists after delete must be False"
        assert backend.get_into([a], [bytearray(3000)]) == [False], "get_into after delete must be False"
        self._expect(backend, b, vb, "a key that was not deleted")
        backend.delete([a, unknown, a])  # deleting unknown or already-deleted keys is fine
        batch = [key_of(f"delete/batch/{i}") for i in range(4)]
        self._put_ok(backend, batch, [value_of(k, 0, 700) for k in batch], "blocks")
        backend.delete(batch[:3])
        kept = [i for i, ok in enumerate(backend.exists(batch[:3])) if ok]
        assert not kept, f"delete of a batch of 3 keys left key(s) at batch position(s) {kept} (only the first deleted?)"
        assert backend.get(batch[:3]) == [None] * 3, "get after a batched delete returned a value of a deleted key"
        self._expect(backend, batch[3], value_of(batch[3], 0, 700), "a key left out of a batched delete")
        va2 = value_of(a, 1, 500)
        self._put_ok(backend, [a], [va2], "a block under a deleted key")
        self._expect(backend, a, va2, "a key stored again after delete", earlier=(va,))

    def test_touch_keeps_values(self, backend: StorageBackend) -> None:
        """`touch` (a request's priority reaching the tier) changes no value and accepts unknown keys."""
        k, unknown = key_of("touch"), key_of("touch/unknown")
        value = value_of(k, 0, 900)
        self._put_ok(backend, [k], [value], "a block")
        assert backend.touch([k, unknown, k], 0) is None, "touch must return None"
        backend.touch([k], 7)
        self._expect(backend, k, value, "a key after touch")
        assert backend.get([unknown]) == [None], "touch of an unknown key must not create it"

    def test_block_infos_keep_values(self, backend: StorageBackend) -> None:
        """`put_blocks` (how kvtier writes, with each block's BlockInfo) stores what `put` would;
        `touch_blocks` changes no value and accepts unknown keys."""
        k, child, unknown = key_of("infos"), key_of("infos/child"), key_of("infos/unknown")
        values = [value_of(k, 0, 300), value_of(child, 0, 301)]
        infos = [BlockInfo(priority=3), BlockInfo(depth=1, parent=k, arrival=1.0, priority=3, session="s")]
        stored = backend.put_blocks([k, child], values, infos)
        _check_result(stored, 2, "put_blocks", bool)
        assert stored == [True, True], f"put_blocks refused blocks well under capacity: {stored}"
        assert backend.touch_blocks([child, unknown], [infos[1], BlockInfo()]) is None, "touch_blocks must return None"
        self._expect(backend, k, values[0], "a key stored by put_blocks")
        self._expect(backend, child, values[1], "a key after touch_blocks")
        assert backend.get([unknown]) == [None], "touch_blocks of an unknown key must not create it"

    # ---- get_into --------------------------------------------------------------------

    def test_get_into(self, backend: StorageBackend) -> None:
        k, empty = key_of("get-into"), key_of("get-into/empty")
        value = value_of(k, 0, 5000)
        self._put_ok(backend, [k, empty], [value, b""], "blocks")
        arena = bytearray(b"\xab" * 6000)
        window = memoryview(arena)[500:5500]
        filled = backend.get_into([k], [window])
        _check_result(filled, 1, "get_into", bool)
        assert filled == [True], "get_into with a buffer of exactly the stored size must return True"
        assert bytes(window) == value, "get_into returned True but the buffer holds wrong bytes"
        assert arena[:500] == b"\xab" * 500 and arena[5500:] == b"\xab" * 500, (
            "get_into wrote outside the buffer it was given"
        )
        for size in (0, 4999, 5001):
            assert backend.get_into([k], [bytearray(size)]) == [False], (
                f"get_into with a {size}-byte buffer for a 5000-byte value must return False (exact size required)"
            )
        self._expect(backend, k, value, "a key after get_into with wrong-size buffers (entry damaged?)")
        buf = bytearray(5000)
        assert backend.get_into([key_of("get-into/unknown"), k, empty], [bytearray(5), buf, bytearray()]) == [
            False, True, True,
        ], "get_into of [unknown, 5000-byte value, empty value] must return [False, True, True]"
        assert bytes(buf) == value, "get_into in a mixed batch filled the buffer with wrong bytes"
        big_key = key_of("get-into/large")
        big = value_of(big_key, 0, self.large_block_bytes)
        self._put_ok(backend, [big_key], [big], "a large block")
        big_buf = bytearray(len(big))
        assert backend.get_into([big_key], [big_buf]) == [True] and big_buf == big, (
            f"get_into of a {len(big)}-byte block did not fill the buffer with the stored bytes"
        )

    def test_scatter_reads(self, backend: StorageBackend) -> None:
        """Only for a `ScatterReads` backend that offers them: a value read into several pieces
        of memory, in order, is the stored value; nothing is written outside the pieces."""
        if not (isinstance(backend, ScatterReads) and backend.scatter_reads):
            pytest.skip("not a ScatterReads backend, or scatter_reads is off here")
        k, unknown = key_of("scatter"), key_of("scatter/unknown")
        value = value_of(k, 0, 5000)
        self._put_ok(backend, [k], [value], "a block")
        cuts = [0, 1, 700, 701, 4096, 5000]
        arena = (ctypes.c_char * 6000)(*([b"\xab"] * 6000))
        at = ctypes.addressof(arena)
        # piece j at offset cuts[j] + 100 * j: gaps of 100 bytes between pieces
        pieces = Scatter(np.array([at + c + 100 * j for j, c in enumerate(cuts[:-1])], np.int64),
                         np.diff(np.array(cuts, np.int64)), keep=arena)
        got = backend.get_into([unknown, k], [Scatter(pieces.addresses, pieces.lengths, keep=arena), pieces])
        _check_result(got, 2, "get_into", bool)
        assert got == [False, True], "get_into of [unknown, value] into Scatter pieces must return [False, True]"
        raw = bytes(arena)
        read = b"".join(raw[c + 100 * j:cuts[j + 1] + 100 * j] for j, c in enumerate(cuts[:-1]))
        assert read == value, "get_into returned True but the Scatter pieces hold wrong bytes"
        gaps = b"".join(raw[cuts[j + 1] + 100 * j:cuts[j + 1] + 100 * (j + 1)] for j in range(len(cuts) - 1))
        assert gaps == b"\xab" * len(gaps), "get_into wrote outside the Scatter pieces it was given"
        short = Scatter(pieces.addresses[:-1], pieces.lengths[:-1], keep=arena)
        assert backend.get_into([k], [short]) == [False], "get_into into Scatter pieces of the wrong size must be False"
        self._expect(backend, k, value, "a key after a Scatter read of the wrong size (entry damaged?)")

    def test_scatter_batch_reads(self, backend: StorageBackend) -> None:
        """Only for a `ScatterReads` backend that offers them: `get_into_batch` gives `get_into`'s
        results, each value in its own pieces, nothing written outside them, threads or not."""
        if not (isinstance(backend, ScatterReads) and backend.scatter_reads):
            pytest.skip("not a ScatterReads backend, or scatter_reads is off here")
        keys = [key_of(f"batch/{j}") for j in range(3)]
        values = [value_of(k, 0, 3000 + 500 * j) for j, k in enumerate(keys)]
        self._put_ok(backend, keys, values, "blocks")
        asked = [keys[2], key_of("batch/unknown"), keys[0], keys[1]]
        sizes = [len(values[2]), 100, len(values[0]), len(values[1]) - 1]  # the last one of the wrong size
        arena = (ctypes.c_char * 20000)(*([b"\xab"] * 20000))
        at, starts, addrs, lens = ctypes.addressof(arena), [0], [], []
        for n in sizes:  # each value in two pieces with a 50-byte gap after each
            for part in (n // 3, n - n // 3):
                addrs.append(at + sum(lens) + 50 * len(lens))
                lens.append(part)
            starts.append(len(lens))
        batch = ScatterBatch(np.array(starts, np.int64), np.array(addrs, np.int64), np.array(lens, np.int64), keep=arena)
        for threads in (1, 3):
            got = backend.get_into_batch(asked, batch, threads)
            _check_result(got, 4, "get_into_batch", bool)
            assert got == [True, False, True, False], (
                f"get_into_batch of [value, unknown, value, value into pieces 1 byte short] with {threads} thread(s) "
                f"must return [True, False, True, False]; got {got}")
            raw = bytes(arena)
            for v, want in ((0, values[2]), (2, values[0])):
                read = b"".join(raw[a - at:a - at + n] for a, n in zip(addrs[starts[v]:starts[v + 1]], lens[starts[v]:starts[v + 1]]))
                assert read == want, "get_into_batch returned True but the value's pieces hold wrong bytes"
            assert all(raw[a - at + n:a - at + n + 50] == b"\xab" * 50 for a, n in zip(addrs, lens)), (
                "get_into_batch wrote outside the pieces it was given")
        _expect_raises((ValueError,), lambda: backend.get_into_batch(asked[:3], batch), "get_into_batch with 3 keys "
                       "and 4 values")
        self._expect(backend, keys[1], values[1], "a key after a batch read of the wrong size (entry damaged?)")

    def test_get_views(self, backend: StorageBackend) -> None:
        k, empty, unknown = key_of("get-views"), key_of("get-views/empty"), key_of("get-views/unknown")
        value = value_of(k, 0, 5000)
        self._put_ok(backend, [k, empty], [value, b""], "blocks")
        got = backend.get_views([unknown, k, empty, k])
        _check_result(got, 4, "get_views", (memoryview, type(None)))
        assert got[0] is None, "get_views of an unknown key must be None"
        assert [bytes(v) for v in got[1:]] == [value, b"", value], (  # type: ignore[union-attr]
            "get_views of [unknown, 5000-byte value, empty value, the same again] returned wrong bytes")

    # ---- bad input -------------------------------------------------------------------

    def test_mismatched_lengths_raise(self, backend: StorageBackend) -> None:
        k1, k2 = key_of("mismatch/1"), key_of("mismatch/2")
        _expect_raises((ValueError,), lambda: backend.put([k1, k2], [b"x"]), "put with 2 keys and 1 block")
        _expect_raises((ValueError,), lambda: backend.put([k1], [b"x", b"y"]), "put with 1 key and 2 blocks")
        _expect_raises((ValueError,), lambda: backend.get_into([k1, k2], [bytearray(1)]), "get_into with 2 keys and 1 buffer")
        assert backend.exists([k1, k2]) == [False, False], "put stored part of a batch it rejected"

    def test_bad_keys_rejected(self, backend: StorageBackend) -> None:
        bad_keys: list[Any] = [b"short", b"x" * 17, b"", "k" * 16, 12345, None, bytearray(16)]
        errors = (TypeError, ValueError)
        for bad in bad_keys:
            label = f"a key {bad!r:.30} ({type(bad).__name__})"
            _expect_raises(errors, lambda: backend.put([bad], [b"data"]), f"put with {label}")
            _expect_raises(errors, lambda: backend.get([bad]), f"get with {label}")
            _expect_raises(errors, lambda: backend.exists([bad]), f"exists with {label}")
            _expect_raises(errors, lambda: backend.delete([bad]), f"delete with {label}")
            _expect_raises(errors, lambda: backend.get_into([bad], [bytearray(4)]), f"get_into with {label}")
        good = key_of("bad-keys/good")
        _expect_raises(errors, lambda: backend.put([good, b"short"], [b"a", b"b"]), "put of a batch with one bad key")
        assert backend.exists([good]) == [False], "put stored part of a batch that had a bad key"

    def test_bad_blocks_rejected(self, backend: StorageBackend) -> None:
        k = key_of("bad-blocks")
        for bad in ("some text", 12345, None, [1, 2, 3]):
            _expect_raises((TypeError, ValueError), lambda: backend.put([k], [bad]),
                           f"put of a {type(bad).__name__} block (not bytes-like)")
        assert backend.exists([k]) == [False], "put stored something for a block it should have rejected"
        _expect_raises((TypeError, ValueError), lambda: backend.get_into([k], [b"read-only"]),
                       "get_into into a read-only bytes buffer")

    # ---- close -----------------------------------------------------------------------

    def test_close(self, backend: StorageBackend) -> None:
        k = key_of("close")
        self._put_ok(backend, [k], [b"v" * 100], "a block")
        backend.close()
        try:
            backend.close()
        except Exception as e:
            raise AssertionError(f"close() must be idempotent, but the second call raised {type(e).__name__}: {e}") from e
        ops: dict[str, Callable[[], Any]] = {
            "get": lambda: backend.get([k]),
            "exists": lambda: backend.exists([k]),
            "put": lambda: backend.put([k], [b"w"]),
            "delete": lambda: backend.delete([k]),
            "get_into": lambda: backend.get_into([k], [bytearray(100)]),
        }
        for name, op in ops.items():
            _expect_raises((BackendError,), op, f"{name} after close")

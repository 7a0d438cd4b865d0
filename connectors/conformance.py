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

import hashlib
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from connectors.backend import BackendError, StorageBackend
from kvstore.keys import BlockKey


def key_of(tag: str) -> BlockKey:
    return BlockKey(hashlib.sha256(tag.encode()).digest()[:16])


def value_of(key: bytes, version: int, size: int) -> bytes:
    """Deterministic bytes for (key, version): every byte value appears, so a backend that
    mangles any of them (text decoding, stripping, ...) fails."""
    data = random.Random(key + version.to_bytes(4, "little")).randbytes(size)
    return (key + version.to_bytes(4, "little") + data)[:size] if size >= 20 else data


def _what_is_wrong(got: Any, want: bytes, earlier: tuple[bytes, ...] = (), others: tuple[bytes, ...] = ()) -> str | None:
    if got is None:
        return "returned None (a miss) although put returned True: data lost without reporting"
    if type(got) is not bytes:
        return f"returned a {type(got).__name__}; the contract says bytes"
    if got == want:
        return None
    if got in earlier:
        return "returned a stale value (an earlier put of the same key)"
    if got in others:
        return "returned another key's value (wrong bytes)"
    if len(got) != len(want):
        return f"returned wrong bytes: {len(got)} bytes where {len(want)} were stored"
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    return f"returned wrong bytes: {len(got)} bytes, first difference at offset {first}"


def _check_result(result: Any, n: int, op: str, kind: type | tuple[type, ...]) -> None:
    assert isinstance(result, list), f"{op} must return a list, got {type(result).__name__}"
    assert len(result) == n, f"{op} must return one result per key: {n} keys, {len(result)} results"
    bad = [r for r in result if not isinstance(r, kind)]
    assert not bad, f"{op} returned {bad[0]!r} ({type(bad[0]).__name__}) among its results"


def _expect_raises(excs: tuple[type[BaseException], ...], fn: Callable[[], Any], what: str) -> None:
    names = " or ".join(e.__name__ for e in excs)
    try:
        result = fn()
    except excs:
        return
    except Exception as e:
        raise AssertionError(f"{what} must raise {names}, but raised {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what} must raise {names}, but returned {result!r:.80}")


class BackendConformance:
    """Mix into a `Test...` class and implement `make_backend(tmp_path)`."""

    large_block_bytes = 1 << 20
    threads = 8
    ops_per_thread = 150
    concurrency_timeout_s = 60.0

    def make_backend(self, tmp_path: Path) -> StorageBackend:
        raise NotImplementedError("subclass BackendConformance and implement make_backend(tmp_path)")

    @pytest.fixture
    def backend(self, tmp_path: Path):
        b = self.make_backend(tmp_path)
        assert isinstance(b, StorageBackend), f"make_backend returned a {type(b).__name__}, not a StorageBackend"
        yield b
        b.close()

    def _put_ok(self, backend: StorageBackend, keys: list[BlockKey], values: list[Any], what: str) -> None:
        result = backend.put(keys, values)
        _check_result(result, len(keys), "put", bool)
        refused = [len(memoryview(v)) for v, ok in zip(values, result) if not ok]
        assert not refused, f"put refused {what} (sizes {refused}) on an empty backend with room for them"

    def _expect(self, backend: StorageBackend, key: BlockKey, want: bytes, what: str, **kw: tuple[bytes, ...]) -> None:
        got = backend.get([key])
        _check_result(got, 1, "get", (bytes, type(None)))
        problem = _what_is_wrong(got[0], want, **kw)
        assert problem is None, f"get of {what} {problem}"

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

    # ---- concurrency -----------------------------------------------------------------

    def _run_threads(self, work: Callable[[int, threading.Barrier], None]) -> list[str]:
        errors: list[str] = []
        barrier = threading.Barrier(self.threads)

        def run(tid: int) -> None:
            try:
                work(tid, barrier)
            except AssertionError as e:
                errors.append(f"thread {tid}: {e}")
            except Exception:
                errors.append(f"thread {tid} raised:\n{traceback.format_exc(limit=6)}")

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # switch threads often, so races show up under the GIL
        try:
            workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(self.threads)]
            for w in workers:
                w.start()
            deadline = time.monotonic() + self.concurrency_timeout_s
            for w in workers:
                w.join(max(0.0, deadline - time.monotonic()))
        finally:
            sys.setswitchinterval(old)
        stuck = sum(w.is_alive() for w in workers)
        assert not stuck, (
            f"backend hung under concurrent use (deadlock?): {stuck} of {self.threads} threads "
            f"still running after {self.concurrency_timeout_s:.0f} s"
        )
        return errors

    def test_concurrent_mixed_ops(self, backend: StorageBackend) -> None:
        keys = [key_of(f"concurrent/{i}") for i in range(24)]
        # Every version of a key has its own length, so a get_into of that length identifies it.
        versions = {k: [value_of(k, v, 200 + 3000 * v + i) for v in range(6)] for i, k in enumerate(keys)}
        allowed = {k: set(vs) for k, vs in versions.items()}
        everything = {v: k for k, vs in versions.items() for v in vs}

        def judge(key: BlockKey, got: bytes, op: str) -> str | None:
            if type(got) is bytes and got in allowed[key]:
                return None
            if type(got) is not bytes:
                return f"{op} returned a {type(got).__name__}, not bytes"
            if got in everything:
                return f"{op} returned another key's value (wrong bytes) under concurrent use"
            return f"{op} returned {len(got)} bytes that no put ever stored for this key (torn or wrong bytes)"

        def work(tid: int, barrier: threading.Barrier) -> None:
            rng = random.Random(tid)
            barrier.wait()
            for _ in range(self.ops_per_thread):
                k = rng.choice(keys)
                r = rng.random()
                if r < 0.4:
                    res = backend.put([k], [rng.choice(versions[k])])
                    assert isinstance(res, list) and len(res) == 1 and isinstance(res[0], bool), f"put returned {res!r}"
                elif r < 0.75:
                    got = backend.get([k])[0]
                    problem = None if got is None else judge(k, got, "get")
                    assert problem is None, problem
                elif r < 0.85:
                    backend.delete([k])
                elif r < 0.93:
                    want = rng.choice(versions[k])
                    buf = bytearray(len(want))
                    if backend.get_into([k], [buf]) == [True]:
                        assert bytes(buf) == want, "get_into returned True with wrong bytes under concurrent use"
                else:
                    res = backend.exists([k])
                    assert res in ([True], [False]), f"exists returned {res!r}"

        errors = self._run_threads(work)
        assert not errors, f"{len(errors)} errors under concurrent put/get/delete; first: {errors[0]}"
        for k in keys:  # quiescent again: an ordinary put/get must still work for every key
            final = versions[k][-1]
            self._put_ok(backend, [k], [final], "a block after the concurrent phase")
            self._expect(backend, k, final, "a key after the concurrent phase", earlier=tuple(versions[k][:-1]))

    def test_concurrent_gets_return_their_own_key(self, backend: StorageBackend) -> None:
        """Transfer threads read different keys at once: each read must return its own key's
        bytes (a shared read buffer, a connection used by two threads at once, ... return
        another read's bytes)."""
        keys = [key_of(f"concurrent-get/{i}") for i in range(self.threads)]
        values = [value_of(k, 0, 64 * 1024 + i) for i, k in enumerate(keys)]
        self._put_ok(backend, keys, values, "blocks")
        everything = dict(zip(values, range(len(values))))

        def work(tid: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for _ in range(20):
                got = backend.get([keys[tid]])[0]
                if got == values[tid]:
                    continue
                if got in everything:
                    raise AssertionError(f"concurrent get returned key {everything[got]}'s value for key {tid} "
                                         "(another key's value): is a read buffer or connection shared between threads?")
                raise AssertionError(f"concurrent get of key {tid} {_what_is_wrong(got, values[tid])} while other "
                                     "threads read other keys: is a read buffer or connection shared between threads?")

        errors = self._run_threads(work)
        assert not errors, f"{len(errors)} errors under concurrent gets of different keys; first: {errors[0]}"

    def test_concurrent_puts_not_lost(self, backend: StorageBackend) -> None:
        per_thread = 40
        keys = [[key_of(f"disjoint/{t}/{i}") for i in range(per_thread)] for t in range(self.threads)]

        def work(tid: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for i, k in enumerate(keys[tid]):
                assert backend.put([k], [value_of(k, 0, 512 + i)]) == [True], (
                    "put refused a small block under concurrent puts of other keys"
                )

        errors = self._run_threads(work)
        assert not errors, f"{len(errors)} errors under concurrent puts; first: {errors[0]}"
        flat = [k for ks in keys for k in ks]
        got = backend.get(flat)
        lost = [i for i, g in enumerate(got) if g is None]
        assert not lost, (
            f"{len(lost)} of {len(flat)} blocks stored concurrently (put returned True) were lost "
            "without reporting: is the backend thread-safe?"
        )
        for t, ks in enumerate(keys):
            for i, k in enumerate(ks):
                problem = _what_is_wrong(got[t * per_thread + i], value_of(k, 0, 512 + i))
                assert problem is None, f"get after concurrent puts {problem}"

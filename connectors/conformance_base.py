"""Shared pieces of the storage-backend conformance kit (`connectors.conformance`): the key and
value generators, the checks that name what is wrong, and the kit's fixture."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from connectors.backend import StorageBackend
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


class KitBase:
    """The fixture and assertions every group of checks uses."""

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

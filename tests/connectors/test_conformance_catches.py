"""The conformance kit fails broken backends, each with a message that says what is wrong.

Three bugs a plugin author can plausibly write (issue 13), each on top of the correct reference
`MemoryBackend`: a batched delete that deletes only the first key, storage under a truncated key,
and one read buffer shared by every thread. The kit's own run on `MemoryBackend`
(test_backend_conformance.py) is the control: the same tests pass there.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from connectors.conformance import BackendConformance
from kvstore.memory import MemoryBackend


class DeletesOnlyFirst(MemoryBackend):
    def delete(self, keys: Sequence[bytes]) -> None:
        super().delete(list(keys)[:1])


class TruncatedKeys(MemoryBackend):
    """Stores under the first 8 bytes of the key: keys that share them share a value."""

    def _k(self, keys: Sequence[bytes]) -> list[bytes]:
        from connectors.backend import check_keys

        check_keys(keys)
        return [k[:8] + bytes(8) for k in keys]

    def exists(self, keys):
        return super().exists(self._k(keys))

    def get(self, keys):
        return super().get(self._k(keys))

    def get_into(self, keys, outs):
        return super().get_into(self._k(keys), outs)

    def put(self, keys, blocks):
        return super().put(self._k(keys), blocks)

    def delete(self, keys):
        super().delete(self._k(keys))


class SharedReadBuffer(MemoryBackend):
    """Copies each value through one scratch buffer, a chunk at a time (as a file read into a
    reused buffer would), without a lock: concurrent gets overwrite each other's bytes."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=64 << 20)
        self._scratch = bytearray(1 << 20)

    def get(self, keys):
        out = []
        for value in super().get(keys):
            if value is None:
                out.append(None)
                continue
            for i in range(0, len(value), 4096):
                self._scratch[i:i + 4096] = value[i:i + 4096]
                time.sleep(0)  # a read syscall: another thread runs here
            out.append(bytes(self._scratch[:len(value)]))
        return out


def kit_for(backend_cls) -> BackendConformance:
    kit = BackendConformance()
    kit.make_backend = lambda tmp_path: backend_cls()  # type: ignore[method-assign]
    return kit


def run_kit_test(kit: BackendConformance, name: str, tmp_path) -> None:
    backend = kit.make_backend(tmp_path)
    try:
        getattr(kit, name)(backend)
    finally:
        backend.close()


@pytest.mark.parametrize("cls,test,message", [
    (DeletesOnlyFirst, "test_delete", "only the first deleted"),
    (TruncatedKeys, "test_keys_differing_in_one_byte_are_distinct", "another key's value"),
    (SharedReadBuffer, "test_concurrent_gets_return_their_own_key", "shared between threads"),
])
def test_kit_fails_the_broken_backend_saying_why(cls, test, message, tmp_path):
    with pytest.raises(AssertionError, match=message):
        run_kit_test(kit_for(cls), test, tmp_path)


def test_the_correct_backend_passes_the_same_tests(tmp_path):
    """Control: the tests above fail because of the bug, not because the kit fails everything."""
    kit = kit_for(MemoryBackend)
    for name in ("test_delete", "test_keys_differing_in_one_byte_are_distinct",
                 "test_concurrent_gets_return_their_own_key"):
        run_kit_test(kit, name, tmp_path)


def test_shared_buffer_bug_is_a_real_race_not_a_single_thread_bug(tmp_path):
    backend = SharedReadBuffer()
    key = bytes(range(16))
    backend.put([key], [b"x" * 100_000])
    assert backend.get([key]) == [b"x" * 100_000]  # alone, it is correct
